"""A rollout worker's LoRA adapter directory (actors/lora_serving.py) outlives a killed worker
only until the next worker on the node starts: no Ray or vLLM needed to check that."""
from __future__ import annotations

import os
import subprocess
import sys

from actors.lora_serving import AdapterSlot


def test_a_new_slot_removes_the_directories_of_gone_workers_only(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)  # a process that has exited (its pid is not reused this soon)
    orphan = tmp_path / f"klrl-lora-w0-p{dead_pid}-abc"
    live = tmp_path / f"klrl-lora-w1-p{os.getpid()}-def"
    other = tmp_path / "klrl-lora-w0-old"  # a name without an owner: never guessed at
    for d in (orphan, live, other):
        (d / "v1").mkdir(parents=True)
    slot = AdapterSlot(2, parent=tmp_path)
    try:
        assert not orphan.exists() and live.exists() and other.exists()
        assert slot.root.parent == tmp_path
        assert slot.root.name.startswith(f"klrl-lora-w2-p{os.getpid()}-")
    finally:
        slot.close()
    assert not slot.root.exists()
