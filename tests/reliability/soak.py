"""`make soak`: mixed, checked traffic for SOAK_SECS (default 600); fails on a lost or wrong answer or on growth."""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.http as httpclient

from tests.reliability.load import MIXED, Kind, Tally, Traffic, WrongAnswerError, build_repository, sample
from tests.support import GeserveProcess, http_status, segments_of_server, write_identity_model

# Growth allowed from the first sample (taken once the traffic has warmed every path up) to the last.
RSS_GROWTH_LIMIT_MIB = 48.0  # front-end, and all workers together, each
RSS_GROWTH_LIMIT_RATIO = 0.25  # ... or this share of the first sample, whichever is larger
FD_GROWTH_LIMIT = 16  # front-end descriptors
SAMPLE_EVERY_S = 30.0
# Once the traffic stops, the front-end must come back near the RSS it had before it started: what a request
# pinned is given back (bodies of megabytes, read in place, once stayed in a reference cycle until a full
# collection). What it may keep: the allocator's retained heap and the paths the traffic warmed up.
IDLE_RSS_LIMIT_MIB = 128.0
IDLE_RSS_LIMIT_RATIO = 0.5  # ... or this share of the idle RSS, whichever is larger
SETTLE_S = 3.0  # after the traffic, before the front-end's RSS is read again
# Large HTTP bodies, 3-6 MiB: read in place by the front-end, as the other kinds' small bodies are not.
LARGE_BODY_MIB = (3, 6)


def http_large_echo(client: httpclient.InferenceServerClient, rng: random.Random) -> None:
    """An identity request of 3-6 MiB of FP32 values, checked on the way back."""
    elements = rng.randint(LARGE_BODY_MIB[0] << 18, LARGE_BODY_MIB[1] << 18)
    data = np.random.default_rng(rng.getrandbits(32)).standard_normal((1, elements), dtype=np.float32)
    tensor = httpclient.InferInput("INPUT0", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data, binary_data=True)
    output = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
    result = client.infer("large_echo", [tensor], outputs=[output])
    if not np.array_equal(result.as_numpy("OUTPUT0"), data):
        raise WrongAnswerError("large_echo OUTPUT0 != INPUT0")


LARGE_BODIES = Kind(
    "HTTP binary / large_echo (identity, 3-6 MiB bodies)",
    2,
    lambda server: httpclient.InferenceServerClient(server.url, network_timeout=60, connection_timeout=5),
    lambda client, _state, rng: http_large_echo(client, rng),
)
SOAK_KINDS = (*MIXED, LARGE_BODIES)


def _idle_failures(idle: dict[str, Any], settled: dict[str, Any]) -> list[str]:
    allowed = max(IDLE_RSS_LIMIT_MIB, idle["frontend_rss_mib"] * IDLE_RSS_LIMIT_RATIO)
    above = settled["frontend_rss_mib"] - idle["frontend_rss_mib"]
    if above > allowed:
        return [
            f"frontend_rss_mib did not come back near idle after the traffic: {settled['frontend_rss_mib']:.1f} MiB, "
            f"{above:.1f} above its idle {idle['frontend_rss_mib']:.1f} (allowed {allowed:.1f})"
        ]
    return []


REPORT = Path(os.environ.get("SOAK_REPORT", "soak-report.json"))


def _growth_failures(first: dict[str, Any], last: dict[str, Any]) -> list[str]:
    failures = []
    for key in ("frontend_rss_mib", "workers_rss_mib"):
        allowed = max(RSS_GROWTH_LIMIT_MIB, first[key] * RSS_GROWTH_LIMIT_RATIO)
        if last[key] - first[key] > allowed:
            failures.append(f"{key} grew {last[key] - first[key]:.1f} MiB (allowed {allowed:.1f})")
    if last["frontend_fds"] - first["frontend_fds"] > FD_GROWTH_LIMIT:
        failures.append(f"front-end descriptors grew from {first['frontend_fds']} to {last['frontend_fds']}")
    if last["shm_segments"] > first["shm_segments"]:
        failures.append(f"/dev/shm segments grew from {first['shm_segments']} to {last['shm_segments']}")
    return failures


def run(duration_s: float, workdir: Path) -> dict[str, Any]:
    repository = build_repository(workdir)
    write_identity_model(repository, "large_echo", max_batch_size=0, dims="-1, -1")
    server = GeserveProcess(workdir / "geserve.log", f"--model-repository={repository}").wait_live()
    pid = server.process.pid
    warm_up_s = min(20.0, duration_s / 5)
    interval_s = min(SAMPLE_EVERY_S, max(duration_s / 6, 1.0))
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    idle = sample(server, started, Tally())
    settled = idle
    try:
        with Traffic(server, SOAK_KINDS) as traffic:
            time.sleep(warm_up_s)
            samples.append(sample(server, started, traffic.tally))
            print(json.dumps(samples[-1]), flush=True)
            end = started + duration_s
            while (now := time.monotonic()) < end:
                time.sleep(min(interval_s, end - now))
                samples.append(sample(server, started, traffic.tally))
                print(json.dumps(samples[-1]), flush=True)
                if server.process.poll() is not None:
                    break
        time.sleep(SETTLE_S)
        settled = sample(server, started, traffic.tally)
        alive = server.process.poll() is None and http_status(f"http://{server.url}/v2/health/ready") == 200
    finally:
        exit_code = server.stop()
    time.sleep(0.5)
    leaked = sorted(segments_of_server(pid))
    tally = traffic.tally
    failures = _growth_failures(samples[0], samples[-1]) if len(samples) > 1 else ["fewer than two samples"]
    failures += _idle_failures(idle, settled)
    for outcome in ("failed", "wrong", "lost", "refused"):
        if tally.total(outcome):
            failures.append(f"{tally.total(outcome)} {outcome} request(s)")
    if not alive:
        failures.append("the server was not alive and ready at the end")
    if exit_code != 0:
        failures.append(f"the server exited with {exit_code} on SIGTERM")
    if leaked:
        failures.append(f"segments left in /dev/shm after exit: {leaked}")
    log = server.log()
    if "Traceback" in log:
        failures.append("the server log has a traceback")
    return {
        "duration_s": round(time.monotonic() - started, 1),
        "requests": tally.total("sent"),
        "ok": tally.total("ok"),
        "failed": tally.total("failed"),
        "wrong": tally.total("wrong"),
        "lost": tally.total("lost"),
        "by_kind": tally.as_json(),
        "bounds": {
            "rss_growth_mib": RSS_GROWTH_LIMIT_MIB,
            "rss_growth_ratio": RSS_GROWTH_LIMIT_RATIO,
            "frontend_fd_growth": FD_GROWTH_LIMIT,
            "frontend_rss_above_idle_mib": IDLE_RSS_LIMIT_MIB,
            "frontend_rss_above_idle_ratio": IDLE_RSS_LIMIT_RATIO,
            "shm_segments": "no more at the end than at the first sample; none of the server's left after exit",
        },
        "samples": samples,
        "first": samples[0],
        "last": samples[-1],
        "idle": idle,
        "settled": settled,
        "exit_code": exit_code,
        "leaked_segments": leaked,
        "failures": failures,
        "passed": not failures,
    }


def table(report: dict[str, Any]) -> str:
    first, last = report["first"], report["last"]
    lines = [
        "| kind | requests | ok | failed | wrong | lost |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind, counts in report["by_kind"].items():
        lines.append(
            f"| {kind} | {counts['sent']} | {counts['ok']} | {counts['failed']} | {counts['wrong']} | {counts['lost']} |"
        )
    lines.append(
        f"| **all, {report['duration_s']:.0f} s** | **{report['requests']}** | {report['ok']} | {report['failed']} "
        f"| {report['wrong']} | {report['lost']} |"
    )
    lines += [
        "",
        "| sample | t (s) | front-end RSS (MiB) | workers RSS (MiB) | front-end fds | /dev/shm segments |",
        "|---|---:|---:|---:|---:|---:|",
        f"| first | {first['t_s']} | {first['frontend_rss_mib']} | {first['workers_rss_mib']} | "
        f"{first['frontend_fds']} | {first['shm_segments']} |",
        f"| last | {last['t_s']} | {last['frontend_rss_mib']} | {last['workers_rss_mib']} | "
        f"{last['frontend_fds']} | {last['shm_segments']} |",
    ]
    for name in ("idle", "settled"):
        row = report[name]
        lines.append(
            f"| {name} | {row['t_s']} | {row['frontend_rss_mib']} | {row['workers_rss_mib']} | "
            f"{row['frontend_fds']} | {row['shm_segments']} |"
        )
    return "\n".join(lines)


def main() -> int:
    duration_s = float(os.environ.get("SOAK_SECS", "600"))
    with tempfile.TemporaryDirectory(prefix="geserve-soak-") as folder:
        report = run(duration_s, Path(folder))
    REPORT.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"report: {REPORT.resolve()}")
    for failure in report["failures"]:
        print(f"FAIL: {failure}", file=sys.stderr)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
