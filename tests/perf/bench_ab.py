"""`make bench-ab BASE=<rev>`: the same perf_analyzer runs against two revisions of geserve, alternating, in one run."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from tests.perf import models
from tests.perf.bench_server import RESULTS, find_perf_analyzer, input_data, run_perf_analyzer
from tests.support import ROOT, GeserveProcess, http_status

# Models and concurrencies measured: one request at a time, and enough at once for the batcher to form batches.
MODELS = ("identity", "simple")
CONCURRENCY = (1, 16)


def checkout(revision: str, folder: Path) -> Path:
    """A detached worktree of `revision` (its generated protobuf code is committed, so it runs as is)."""
    subprocess.run(["git", "worktree", "add", "--detach", str(folder), revision], cwd=ROOT, check=True)
    return folder


def measure(
    tree: Path, repository: Path, work: Path, tool: str, interval_ms: int, cases: list[tuple[str, str, int]]
) -> dict[str, dict[str, float]]:
    """Every (model, protocol, concurrency) case once against the geserve of `tree`."""
    server = GeserveProcess(work / f"{tree.name}.log", f"--model-repository={repository}", cwd=tree).wait_live()
    figures: dict[str, dict[str, float]] = {}
    try:
        assert http_status(f"http://{server.url}/v2/health/ready") == 200
        for model, protocol, concurrency in cases:
            port = server.http_port if protocol == "http" else server.grpc_port
            data = work / f"{model}.json"
            figures[f"{model} {protocol} c={concurrency}"] = _stable_run(
                tool, model, protocol, port, concurrency, data, interval_ms
            )
    finally:
        server.stop()
    return figures


def _stable_run(
    tool: str, model: str, protocol: str, port: int, concurrency: int, data: Path, interval_ms: int
) -> dict[str, float]:
    """perf_analyzer's figures; a run the shared machine kept from stabilizing is retried with longer windows."""
    for attempt in range(3):
        try:
            return run_perf_analyzer(tool, model, protocol, port, concurrency, data, interval_ms * 2**attempt)
        except RuntimeError:
            if attempt == 2:
                raise
            print(f"  {model} {protocol} c={concurrency}: no stable measurement, retrying with longer windows")
    raise AssertionError("unreachable")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", required=True, help="the revision to compare against (A)")
    parser.add_argument("--candidate", default="", help="the revision measured as B (default: the working tree)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--interval-ms", type=int, default=2000, help="perf_analyzer measurement window")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--concurrency", nargs="+", type=int, default=list(CONCURRENCY))
    arguments = parser.parse_args()
    cases = [
        (model, protocol, concurrency)
        for model in arguments.models
        for protocol in ("http", "grpc")
        for concurrency in arguments.concurrency
    ]
    tool = find_perf_analyzer()
    work = Path(tempfile.mkdtemp(prefix="geserve-ab-"))
    repository = work / "models"
    inputs = models.build(repository)
    for model, tensors in inputs.items():
        shutil.move(input_data(work, tensors), work / f"{model}.json")
    candidate = checkout(arguments.candidate, work / "candidate") if arguments.candidate else ROOT
    trees = {"A": checkout(arguments.base, work / "base"), "B": candidate}
    samples: dict[str, dict[str, list[dict[str, float]]]] = {"A": {}, "B": {}}
    try:
        for round_number in range(arguments.rounds):
            # A then B in even rounds, B then A in odd ones: drift on a shared machine hits both alike.
            order = ("A", "B") if round_number % 2 == 0 else ("B", "A")
            for side in order:
                print(f"round {round_number + 1}/{arguments.rounds}: {side} ({trees[side]})", flush=True)
                for case, figures in measure(trees[side], repository, work, tool, arguments.interval_ms, cases).items():
                    samples[side].setdefault(case, []).append(figures)
    finally:
        for tree in {trees["A"], trees["B"]} - {ROOT}:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    report = {"base": arguments.base, "candidate": arguments.candidate, "rounds": arguments.rounds, "samples": samples}
    (RESULTS / f"ab-{stamp}.json").write_text(json.dumps(report, indent=2))
    print(f"\nwrote bench-results/ab-{stamp}.json\n")
    print(table(arguments.base, arguments.candidate or "working tree", samples))


def table(base: str, candidate: str, samples: dict[str, dict[str, list[dict[str, float]]]]) -> str:
    """Medians over the rounds, and B / A."""
    lines = [
        f"| case | A ({base}) infer/s | B ({candidate}) infer/s | B / A | A p50 ms | B p50 ms | B / A |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in samples["A"]:
        a_rate = statistics.median(s["infer_per_s"] for s in samples["A"][case])
        b_rate = statistics.median(s["infer_per_s"] for s in samples["B"][case])
        a_p50 = statistics.median(s["p50_us"] for s in samples["A"][case]) / 1000
        b_p50 = statistics.median(s["p50_us"] for s in samples["B"][case]) / 1000
        lines.append(
            f"| {case} | {a_rate:.0f} | {b_rate:.0f} | {b_rate / a_rate:.2f} | {a_p50:.2f} | {b_p50:.2f} | "
            f"{b_p50 / a_p50:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
