"""cluster/bench/gpu_payload.sh on CPU, on a made-up payload: the call sequence it prints for
today's tree, and `unpack` (the smoke run's first step) installing the payload through a .pth
file with its bytecode compiled. The real payload (hundreds of MB of GPU wheels) is built
only by hand (docs/gpu.md)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

from cluster.config.loader import REPO_ROOT

SCRIPT = REPO_ROOT / "cluster" / "bench" / "gpu_payload.sh"
MIB = 2**20


def _tree_bytes() -> int:
    names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO_ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum(os.lstat(REPO_ROOT / n.decode()).st_size for n in names
               if n and os.path.lexists(REPO_ROOT / n.decode()))


def _calls(tmp_path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "calls"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "GPU_DIR": str(tmp_path / "gpu"), **env})


def test_the_calls_it_prints_fit_todays_tree_in_the_fewest_calls(tmp_path):
    """Every stash call carries one chunk beside the tree, the last one the last chunk and
    .gpu/check beside it, each under a call's 64 MiB, in as few calls as that allows."""
    call, check, payload = 64 * MIB, 4_000_000, 102_800_000
    done = _calls(tmp_path, PAYLOAD_BYTES=str(payload))
    assert done.returncode == 0, done.stderr
    n = int(re.search(r"(\d+) run call\(s\)", done.stdout).group(1))
    first = call - _tree_bytes() - MIB
    last = first - check
    assert (n - 1) * first + last >= payload > (n - 2) * first + last  # the fewest
    lines = re.findall(r"^ (\d+)\. (.*)$", done.stdout, re.MULTILINE)
    assert [int(i) for i, _ in lines] == list(range(1, n + 2))
    for i, line in lines[:-2]:
        assert f'carry=[".gpu/up{i}"]' in line and "gpu_payload.sh stash" in line
    assert f'carry=[".gpu/up{n}", ".gpu/check"]' in lines[-2][1]
    assert "gpu_payload.sh smoke verdict 540" in lines[-2][1] and "timeout_s=600" in lines[-2][1]
    assert lines[-1][1] == "give_back()"
    # a smaller call limit takes more calls; one too small for the tree is refused
    more = _calls(tmp_path, PAYLOAD_BYTES=str(payload), CALL_BYTES=str(call + 8 * MIB))
    assert int(re.search(r"(\d+) run call\(s\)", more.stdout).group(1)) <= n
    refused = _calls(tmp_path, CALL_BYTES=str(_tree_bytes() + 2 * MIB))
    assert refused.returncode == 1 and "leaves no room" in refused.stderr


def test_unpack_installs_the_payload_through_a_pth_file_with_its_bytecode(tmp_path):
    src, g, chunks, site, pth = (tmp_path / n for n in ("src", "gpu", "up", "site", "pth"))
    (src / "fakepkg").mkdir(parents=True)
    (src / "fakepkg" / "__init__.py").write_text("X = 1\n")
    tarball = tmp_path / "payload.tar.xz"
    subprocess.run(f"tar -C {src} -cf - . | xz -1 > {tarball}", shell=True, check=True)
    data = tarball.read_bytes()
    for i, chunk in ((1, data[:len(data) // 2]), (2, data[len(data) // 2:])):
        (g / f"up{i}").mkdir(parents=True)
        (g / f"up{i}" / f"part.0{i - 1}").write_bytes(chunk)
    (g / "check" / "klrl_home" / "models").mkdir(parents=True)
    (g / "check" / "parts.txt").write_text("part.00\npart.01\n")
    (g / "check" / "payload.sha256").write_text(
        f"{hashlib.sha256(data).hexdigest()}  payload.tar.xz\n")
    details = tmp_path / "details.json"
    env = {**os.environ, "GPU_DIR": str(g), "SITE": str(site), "CHUNKS": str(chunks),
           "PTH_DIR": str(pth), "PYTHON": sys.executable, "KLRL_HOME": str(tmp_path / "home"),
           "SMOKE_DETAILS": str(details)}
    done = subprocess.run(["bash", str(SCRIPT), "unpack"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (pth / "klrl-payload.pth").read_text().strip() == str(site)
    assert list((site / "fakepkg" / "__pycache__").glob("__init__.*.pyc"))  # compiled
    found = json.loads(details.read_text())
    assert found["pth"] == str(pth / "klrl-payload.pth") and found["compile_s"] >= 0
    # a process whose PYTHONPATH does not name the payload finds it through the .pth file
    probe = subprocess.run([sys.executable, "-c", f"import site; site.addsitedir({str(pth)!r}); "
                            "import fakepkg; print(fakepkg.X)"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": ""}, timeout=60)
    assert probe.stdout.strip() == "1", probe.stderr


def test_unpack_without_a_payload_skips_itself_with_its_reason(tmp_path):
    details = tmp_path / "details.json"
    done = subprocess.run(["bash", str(SCRIPT), "unpack"], cwd=REPO_ROOT, timeout=120,
                          capture_output=True, text=True,
                          env={**os.environ, "GPU_DIR": str(tmp_path / "none"),
                               "PYTHON": sys.executable, "SMOKE_DETAILS": str(details)})
    import importlib.util

    if all(importlib.util.find_spec(m) for m in ("vllm", "ray", "deepspeed")):  # the CPU stack
        assert done.returncode == 0 and "are installed" in details.read_text(), done.stderr
    else:
        assert done.returncode == 77 and "nothing to unpack" in details.read_text(), done.stderr
