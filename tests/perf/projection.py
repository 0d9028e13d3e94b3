"""Images/s a bigger host (16 cores, 8 NPUs) could serve, projected from measured CPU ms per image by role."""

from __future__ import annotations

from dataclasses import dataclass

HOST_CORES, HOST_NPUS = 16, 8


@dataclass(frozen=True)
class Projection:
    """The projected images/s, what bounds it, and the arithmetic behind it, line by line."""

    images_per_s: float
    bound: str
    lines: list[str]


def processes_per_role(frontend_processes: int, npus: int) -> dict[str, int]:
    """How many processes share each role's work on the projected host: one worker per NPU (one instance per
    device, as the benchmark's config has), N protocol processes, one of everything else."""
    return {"server": 1, "supervisor": 1, "engine": 1, "protocol": frontend_processes, "worker": npus}


def project_host(
    cpu_ms_per_image: dict[str, float],
    frontend_processes: int,
    per_npu_images_per_s: float,
    cores: int = HOST_CORES,
    npus: int = HOST_NPUS,
) -> Projection:
    """min(CPU ceiling, busiest-process ceiling, device ceiling).

    CPU ceiling: `cores` divided by the cores one image/s needs (the sum over roles of ms/image / 1000).
    Process ceiling: a Python process does its share of the work on about one core (the GIL), so a role whose
    work is spread over p processes tops out at p x 1000 / (its ms/image) images/s.
    Device ceiling: `npus` x the images/s one NPU does at its best gear."""
    used = {role: ms for role, ms in cpu_ms_per_image.items() if ms > 0}
    lines = [f"{cores} cores, {npus} NPUs, --frontend-processes {frontend_processes}:"]
    for role, ms in used.items():
        lines.append(f"  {role:10} {ms:7.3f} ms/image -> {ms / 1000:.6f} cores per image/s")
    total_ms = sum(used.values())
    cpu_ceiling = cores * 1000 / total_ms if total_ms else float("inf")
    lines.append(
        f"  total      {total_ms:7.3f} ms/image -> CPU ceiling {cores} / {total_ms / 1000:.6f} = {cpu_ceiling:.0f} images/s"
    )
    processes = processes_per_role(frontend_processes, npus)
    ceilings = {role: processes[role] * 1000 / ms for role, ms in used.items()}
    busiest = min(ceilings, key=lambda role: ceilings[role]) if ceilings else ""
    if busiest:
        lines.append(
            f"  busiest process: {busiest}, {processes[busiest]} x 1000 / {used[busiest]:.3f} = "
            f"{ceilings[busiest]:.0f} images/s (one core per process)"
        )
    device_ceiling = npus * per_npu_images_per_s
    lines.append(f"  device ceiling {npus} x {per_npu_images_per_s:.0f} = {device_ceiling:.0f} images/s")
    candidates = {"CPU": cpu_ceiling}
    if busiest:
        candidates[f"{busiest} process"] = ceilings[busiest]
    candidates["device"] = device_ceiling
    bound = min(candidates, key=lambda name: candidates[name])
    arguments = ", ".join(f"{name} {value:.0f}" for name, value in candidates.items())
    lines.append(f"  projected min({arguments}) = {candidates[bound]:.0f} images/s, bound by the {bound}")
    return Projection(candidates[bound], bound, lines)
