"""A checkpoint of a run of 2 processes resumes it to the bit (2 gloo processes on the CPU, float32,
FSDP2): the same records after the checkpoint's step and the same final weights as the run that went
straight through. tests/gpu/test_multi_gpu.py checks the same on 2 GPUs through NCCL."""

from __future__ import annotations

from pathlib import Path

import torch
from cli_runs import assert_resume_continues_the_run
from safetensors.torch import load_file
from tiny_recipe import write_recipe


def test_a_two_process_checkpoint_resumes_the_run_bitwise(tmp_path: Path):
    # A step of 2 packs, 1 a process; the learning rate changes at every step (warmup, then cosine).
    path = write_recipe(tmp_path, train={"micro_batch_size": 1, "grad_accum_steps": 1, "eval_every": None},
                        optim={"warmup_steps": 2}, distributed={"strategy": "fsdp"})
    run_dir = tmp_path / "run"
    straight_final = assert_resume_continues_the_run(path, run_dir, processes=2, steps=4, save_at=2,
                                                     loss_rtol=0.0, grad_norm_rtol=0.0)
    straight, resumed = (load_file(folder / "model.safetensors") for folder in (straight_final, run_dir / "final"))
    assert straight.keys() == resumed.keys()
    for name, weight in straight.items():
        assert torch.equal(resumed[name], weight), name
