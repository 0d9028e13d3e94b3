#!/bin/sh
# Put CANN's libraries and pyACL on the paths (toolkit or nnrt, whichever the image has), then serve.
set -e
for env_script in /usr/local/Ascend/ascend-toolkit/set_env.sh /usr/local/Ascend/nnrt/set_env.sh; do
    if [ -f "$env_script" ]; then
        # shellcheck disable=SC1090
        . "$env_script"
        break
    fi
done
if [ ! -d /usr/local/Ascend/driver/lib64 ]; then
    echo "geserve: the NPU driver is not mounted at /usr/local/Ascend/driver; .om models will not load" >&2
fi
mkdir -p "${ASCEND_PROCESS_LOG_PATH:-/tmp/ascend/log}" 2>/dev/null || true
exec geserve "$@"
