"""Starting or joining Ray: a wrong address fails in seconds with one line that says where, what
failed and what to do, instead of ray.init retrying for minutes and ending in a traceback."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from relayrl.launch import CONNECT_TIMEOUT_S, RayStartError, _not_a_ray_head, check_ray_head

ROOT = Path(__file__).resolve().parents[1]
REFUSED = "127.0.0.1:1"  # nothing listens on port 1


def test_a_refused_address_names_it_and_says_how_to_start_ray():
    with pytest.raises(RayStartError) as info:
        check_ray_head(REFUSED)

    message = str(info.value)
    assert message.startswith(f"cannot join Ray at {REFUSED}")
    assert ": connection refused; run `ray start --head --port=1` on that machine" in message
    assert message.endswith("or drop --ray-address (ray.address) to start an embedded Ray")


def test_a_running_ray_head_answers_the_check(ray_session):
    address = ray_session.get_runtime_context().gcs_address

    assert _not_a_ray_head(address, CONNECT_TIMEOUT_S) is None


def test_an_unresolvable_host_is_named():
    with pytest.raises(RayStartError, match="cannot resolve host nosuchhost.invalid; "):
        check_ray_head("nosuchhost.invalid:6379")


@pytest.mark.parametrize("address", ["6379", "head:port", ":6379"])
def test_an_address_that_is_not_host_port_is_refused_as_such(address):
    with pytest.raises(RayStartError, match="not host:port, auto or ray://host:port"):
        check_ray_head(address)


def test_a_port_held_by_another_server_is_not_taken_for_a_ray_head():
    # Bound on every interface: Ray, and so the check, dials 127.0.0.1 as this machine's address.
    server = http.server.HTTPServer(("", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(RayStartError, match="something other than a Ray head answers there"):
            check_ray_head(f"127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()


def test_a_port_that_accepts_but_never_answers_fails_after_the_timeout():
    silent = socket.create_server(("", 0))  # the kernel accepts connections; nobody reads them
    try:
        with pytest.raises(RayStartError, match="does not answer as a Ray head within 0.5 s"):
            check_ray_head(f"127.0.0.1:{silent.getsockname()[1]}", timeout=0.5)
    finally:
        silent.close()


# ``relayrl train`` on the arith config twice in one fresh interpreter (each start would pay the
# torch import): joining a refused address, then starting an embedded Ray. Prints each exit code
# after the summary the job prints; a line "--" on stderr parts their messages.
TWO_FAILED_STARTS = """
import sys
from relayrl.cli import main
refused, first, second = sys.argv[1:]
train = ["train", "configs/arith.yaml", "log.tensorboard=false"]
print("exit", main([*train, "--ray-address", refused, f"--run-dir={first}"]), flush=True)
print("--", file=sys.stderr, flush=True)
print("exit", main([*train, f"--run-dir={second}"]))
"""


@pytest.fixture(scope="module")
def failed_starts(tmp_path_factory) -> tuple[Path, list[list[str]]]:
    """A scratch folder with ``refused/`` and ``embedded/`` run directories, and the stderr lines
    of each start, both of which exited 1."""
    tmp = tmp_path_factory.mktemp("starts")
    (tmp / "file").write_text("")
    # Ray makes its session directories under RAY_TMPDIR: here, under a file.
    env = os.environ | {"RAY_TMPDIR": str(tmp / "file" / "ray")}
    cmd = [sys.executable, "-c", TWO_FAILED_STARTS, REFUSED, tmp / "refused", tmp / "embedded"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    codes = [line for line in result.stdout.splitlines() if line.startswith("exit ")]
    assert codes == ["exit 1", "exit 1"], result.stderr
    assert "Traceback" not in result.stderr
    first, second = result.stderr.split("--\n")
    return tmp, [first.splitlines(), second.splitlines()]


def test_train_with_a_refused_address_exits_1_with_one_line_and_a_failed_summary(failed_starts):
    tmp, (lines, _) = failed_starts

    assert len(lines) == 2, lines  # the job's progress line, then the error
    assert lines[0] == f"relayrl: joining Ray at {REFUSED}"
    assert lines[1].startswith(f"relayrl: cannot join Ray at {REFUSED}")
    assert "connection refused" in lines[1]
    summary = json.loads((tmp / "refused" / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert "RayStartError" in summary["error"] and "connection refused" in summary["error"]


def test_an_embedded_ray_that_cannot_start_exits_1_with_the_reason(failed_starts):
    tmp, (_, lines) = failed_starts

    assert lines == [
        "relayrl: starting Ray",
        f"relayrl: cannot start an embedded Ray: NotADirectoryError: [Errno 20] Not a directory: "
        f"'{tmp / 'file' / 'ray'}'",
    ]
    assert json.loads((tmp / "embedded" / "summary.json").read_text())["status"] == "failed"
