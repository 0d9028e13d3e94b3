"""How the project is built and started outside a cluster: the images (base digests, labels, PID 1, what they hold,
the build context), `make run` and `make models`, and the README's quick start."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from geserve.cli import parse_settings
from tests.deploy.manifests import DEPLOY
from tests.support import ROOT

DOCKER = DEPLOY / "docker"
IMAGES = ["Dockerfile.cpu", "Dockerfile.ascend"]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, comments dropped and continuation lines joined."""
    lines = [line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    found = []
    for line in joined.splitlines():
        if line.strip():
            name, _, rest = line.strip().partition(" ")
            found.append((name.upper(), rest.strip()))
    return found


def _expand(word: str, args: dict[str, str]) -> str:
    """Docker's substitution of build arguments: $NAME, ${NAME}, ${NAME:-word} (word where NAME is empty) and
    ${NAME:+word} (word where NAME is set and not empty) (moby/buildkit frontend/dockerfile/shell/lex.go)."""

    def one(match: re.Match[str]) -> str:
        name, modifier, alternative = match["name"] or match["bare"], match["modifier"], match["word"]
        value = args.get(name, "")
        if modifier == ":-":
            return value or alternative
        if modifier == ":+":
            return alternative if value else ""
        return value

    pattern = r"\$(?:\{(?P<name>\w+)(?:(?P<modifier>:[-+])(?P<word>[^}]*))?\}|(?P<bare>\w+))"
    return re.sub(pattern, one, word)


def _base_image(dockerfile: Path, **given: str) -> str:
    """The image the last FROM names with the build arguments `given` (else the ARG defaults before it)."""
    args: dict[str, str] = {}
    base = ""
    for name, rest in _instructions(dockerfile):
        if name == "ARG" and not base:
            key, _, default = rest.partition("=")
            args[key] = given.get(key, default)
        elif name == "FROM":
            base = _expand(rest.split()[0], args)
    return base


def _labels(dockerfile: Path) -> dict[str, str]:
    args: dict[str, str] = {}
    labels: dict[str, str] = {}
    for name, rest in _instructions(dockerfile):
        if name == "ARG":
            key, _, default = rest.partition("=")
            args[key] = default
        elif name == "LABEL":
            for pair in shlex.split(rest):
                key, _, value = pair.partition("=")
                labels[key] = _expand(value, args)
    return labels


# -- images ----------------------------------------------------------------------------------------


def test_the_argument_expansion_follows_docker() -> None:
    args = {"A": "x", "E": ""}
    assert _expand("${A}/$A:${E:-d}${A:+@}${E:+@}", args) == "x/x:d@"


def test_the_base_images_are_pinned_by_digest() -> None:
    assert re.fullmatch(r"python:3\.11-slim@sha256:[0-9a-f]{64}", _base_image(DOCKER / "Dockerfile.cpu"))
    # The CANN image is the builder's choice (its driver and chip): CANN_DIGEST pins whichever it is.
    ascend = DOCKER / "Dockerfile.ascend"
    tag = _base_image(ascend)
    assert tag.startswith("ascendai/cann:") and "@" not in tag
    digest = "sha256:" + "0" * 64
    assert _base_image(ascend, CANN_DIGEST=digest) == f"{tag}@{digest}"
    other = "ascendai/cann:8.2.rc1-910b-ubuntu22.04-py3.11"
    assert _base_image(ascend, CANN_IMAGE=other, CANN_DIGEST=digest) == f"{other}@{digest}"
    assert DIGEST.search(_base_image(ascend, CANN_DIGEST=digest))
    readme = (DEPLOY / "README.md").read_text()
    assert "CANN_DIGEST=sha256:" in readme and "docker buildx imagetools inspect" in readme


@pytest.mark.parametrize("image", IMAGES)
def test_the_images_say_what_they_are(image: str) -> None:
    labels = _labels(DOCKER / image)
    assert labels["org.opencontainers.image.version"] == PROJECT["version"]
    assert labels["org.opencontainers.image.source"] == PROJECT["urls"]["Source"]
    assert labels["org.opencontainers.image.licenses"] == PROJECT["license"]
    assert labels["org.opencontainers.image.title"].startswith("geserve")


@pytest.mark.parametrize("image", IMAGES)
def test_the_images_hold_the_installed_package_and_the_models_only(image: str) -> None:
    """No copy of the source tree in any layer: it would be a second geserve beside site-packages (the one
    `python -m geserve` finds from its folder) and ship the repository with the image."""
    instructions = _instructions(DOCKER / image)
    copied = [rest.split()[-2] for name, rest in instructions if name == "COPY"]
    assert set(copied) <= {"model_repository", "deploy/docker/ascend-entrypoint.sh"}, copied
    installs = [rest for name, rest in instructions if name == "RUN" and "pip install" in rest]
    assert len(installs) == 1
    mount = re.match(r"--mount=type=bind,target=(\S+),rw ", installs[0])
    assert mount is not None, installs[0]  # the context, for this RUN only
    assert f'"{mount[1]}[onnx]"' in installs[0] and " -e " not in installs[0]


@pytest.mark.parametrize("image", IMAGES)
def test_pid_1_is_an_init_that_forwards_signals_and_reaps(image: str) -> None:
    instructions = _instructions(DOCKER / image)
    entrypoint = next(rest for name, rest in reversed(instructions) if name == "ENTRYPOINT")
    assert entrypoint.startswith('["tini", "--", '), entrypoint
    runs = [rest for name, rest in instructions if name == "RUN"]
    assert any(re.search(r"(apt-get install|yum install)[^|&;()]*\btini\b", run) for run in runs)
    readme = (DEPLOY / "README.md").read_text()
    assert "docker run --init" in readme.replace("\n", " ") and "subreaper" in readme


# -- the build context -----------------------------------------------------------------------------


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore's patterns leave `path` out of the context: the last pattern that matches the path or
    a folder above it decides, `!` bringing it back; `*` and `?` stay within a path element, `**` spans any
    (moby/patternmatcher MatchesOrParentMatches)."""
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern.removeprefix("!").strip("/")
        regex = ""
        for part in re.split(r"(\*\*/?|\*|\?|\[[^]]*\])", body):
            if part.startswith("**"):
                regex += "(?:.*/)?" if part.endswith("/") else ".*"
            elif part == "*":
                regex += "[^/]*"
            elif part == "?":
                regex += "[^/]"
            elif part.startswith("["):
                regex += part
            else:
                regex += re.escape(part)
        elements = path.split("/")
        if any(re.fullmatch(regex, "/".join(elements[:end])) for end in range(1, len(elements) + 1)):
            ignored = not negated
    return ignored


def test_the_build_context_holds_what_the_images_read_and_nothing_else() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    patterns = [line for line in patterns if line and not line.startswith("#")]
    assert _ignored("a/b/__pycache__/c.pyc", ["**/__pycache__"]) and not _ignored("a", ["*", "!a"])
    needed = ["pyproject.toml", "README.md", "LICENSE", "deploy/docker/constraints.txt"]
    needed += ["deploy/docker/ascend-entrypoint.sh", "model_repository/simple/config.pbtxt"]
    needed += [
        str(path.relative_to(ROOT)) for path in (ROOT / "geserve").rglob("*.py") if "__pycache__" not in path.parts
    ]
    for image in IMAGES:  # whatever the Dockerfiles copy or read from the mounted context
        for name, rest in _instructions(DOCKER / image):
            if name == "COPY":
                needed.append(rest.split()[-2])
            needed += re.findall(r"/tmp/src/(\S+?)[\s\"]", rest + " ")
    for path in needed:
        assert not _ignored(path, patterns), f"{path} is needed by the images but left out of the context"
    for path in (
        ".venv/bin/python", ".git/HEAD", ".pytest_cache/README.md", ".mypy_cache/3.11/x.json", ".ruff_cache/x",
        ".hypothesis/examples/x", "bench-results/npu.json", "build/oldest-venv/x", "geserve.egg-info/PKG-INFO",
        "geserve/__pycache__/cli.cpython-311.pyc", "tests/deploy/test_build.py", "docs/README.md",
    ):  # fmt: skip
        assert _ignored(path, patterns), f"{path} would be sent with every build"


# -- make ------------------------------------------------------------------------------------------


def _make(*args: str) -> list[list[str]]:
    """The commands `make` would run for `args`, every target remade, in a venv that is never made."""
    if shutil.which("make") is None:
        pytest.skip("no make here")
    result = subprocess.run(
        ["make", "--no-print-directory", "-n", "-B", "VENV=/nonexistent/venv", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return [shlex.split(line) for line in result.stdout.replace("\\\n", " ").splitlines() if line.strip()]


def _served(commands: list[list[str]]) -> tuple[int, int, int]:
    served = [words for words in commands if words and words[0].endswith("/geserve")]
    assert len(served) == 1, commands
    options = parse_settings(served[0][1:])
    return options.http.port, options.grpc.port, options.metrics.port


def test_make_run_serves_on_the_ports_it_is_given() -> None:
    assert _served(_make("run")) == (8000, 8001, 8002)  # what the README's quick start says
    assert _served(_make("run", "HTTP_PORT=9000", "GRPC_PORT=9001", "METRICS_PORT=9002")) == (9000, 9001, 9002)
    quick_start = (ROOT / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert ":8000 (HTTP), :8001 (gRPC) and :8002" in quick_start
    assert "make run HTTP_PORT=9000 GRPC_PORT=9001 METRICS_PORT=9002" in quick_start


def test_make_models_installs_the_models_extra_only_and_nothing_into_the_tree() -> None:
    """scripts/make_models.py imports onnx, scikit-learn, skl2onnx and numpy, never geserve: the models extra is all
    it needs. An editable install of geserve would write geserve.egg-info into the clone."""
    commands = [" ".join(words) for words in _make("models")]
    installs = [command for command in commands if "pip install" in command]
    assert len(installs) == 1, commands
    assert "[test]" not in installs[0] and " -e " not in installs[0] and "'.[" not in installs[0]
    assert any(command.endswith("scripts/make_models.py") for command in commands)
    snippet = re.search(r"-c (import tomllib.*?) \| ", installs[0])
    assert snippet is not None, installs[0]
    listed = subprocess.run([sys.executable, "-c", snippet[1]], cwd=ROOT, capture_output=True, text=True, check=True)
    assert listed.stdout.split() == PROJECT["optional-dependencies"]["models"]


def test_the_quick_start_installs_the_light_client() -> None:
    quick_start = (ROOT / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "pip install 'tritonclient[http,grpc]'" in quick_start
    assert "tritonclient[all]" not in quick_start
