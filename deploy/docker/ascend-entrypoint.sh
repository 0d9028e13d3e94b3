#!/bin/sh
# Put CANN's libraries and pyACL on the paths (toolkit or nnrt, whichever the image has), then serve.
set -e
ascend_root=/usr/local/Ascend
# geserve's virtual environment stays off PATH, so that ATC's operator compiler finds the image's python3, not the
# venv's (numpy 2, none of CANN's packages): geserve is started by its path.
geserve=/opt/geserve/venv/bin/geserve
# CANN 8.5 and newer install the toolkit's set_env.sh under cann/, older CANN under ascend-toolkit/: the newest first.
sourced=""
for env_script in "$ascend_root/cann/set_env.sh" "$ascend_root/ascend-toolkit/set_env.sh" \
    "$ascend_root/nnrt/set_env.sh"; do
    if [ -f "$env_script" ]; then
        # shellcheck disable=SC1090
        . "$env_script"
        sourced="$env_script"
        break
    fi
done
if [ -z "$sourced" ]; then
    echo "geserve: no CANN set_env.sh at $ascend_root/cann/set_env.sh (CANN 8.5 and newer)," \
        "$ascend_root/ascend-toolkit/set_env.sh (older CANN) or $ascend_root/nnrt/set_env.sh;" \
        "pyACL will not import and .om models will not load" >&2
fi
if [ ! -d "$ascend_root/driver/lib64" ]; then
    echo "geserve: the NPU driver is not mounted at $ascend_root/driver; .om models will not load" >&2
fi
mkdir -p "${ASCEND_PROCESS_LOG_PATH:-/tmp/ascend/log}" 2>/dev/null || true
exec "$geserve" "$@"
