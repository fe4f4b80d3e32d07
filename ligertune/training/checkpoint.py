"""A run's checkpoints: written, found, verified and restored in this one module.

    OUTPUT/
      recipe.yaml                 the resolved recipe
      metrics.jsonl               one JSON object per record (`ligertune.metrics`)
      checkpoints/
        step-000200/              model (or LoRA adapters) + tokenizer, Hugging Face format,
                                  and Medusa heads (over a frozen model: the heads alone + tokenizer),
          optimizer/              the optimizer state (torch.distributed.checkpoint, any world size)
          trainer_state.pt        and the rest of the run: its `RunState`, schedule, RNG, recipe
        step-000400/
        latest -> step-000400     a symbolic link, moved only once its target is complete
      final/                      the model at the end of the run
      .lock                       the PID of the process writing here

A checkpoint is written into a temporary sibling (`.step-000400.tmp-*`), every file fsynced, then
renamed into place (`ligertune.files`); `latest` is then replaced by a new link in one rename. A
crash or a failed write at any point leaves the previous checkpoint and `latest` as they were.

`save_checkpoint` and `restore_checkpoint` are the pair: what one writes under `TrainerState`'s
keys, the other reads back. Before a checkpoint is used, `find_checkpoint` verifies its files (the
trainer state loads, every weights file's header and sizes are whole, the optimizer's metadata is
there); a damaged `latest` gives way to the newest complete checkpoint, with a notice.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from ligertune.distributed import all_reduce_max, barrier, gather_objects, is_main_process
from ligertune.errors import EnvironmentFault, UserError
from ligertune.files import fsync_dir, write_atomic_dir
from ligertune.models.medusa import HEADS_FILE, load_heads, save_base_note, save_heads
from ligertune.training.precision import MASTER
from ligertune.training.run import Run, TrainingDiverged
from ligertune.training.run_dir import CHECKPOINTS
from ligertune.training.state import RunState, capture_rng, restore_rng
from ligertune.weights import DamagedFile, check_safetensors, load_torch_file

LATEST = "latest"
TRAINER_STATE = "trainer_state.pt"
OPTIMIZER = "optimizer"
FORMAT = 2
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


class TrainerState:
    """The keys of `trainer_state.pt`: everything of a run that is neither weights nor optimizer."""

    FORMAT = "format"
    WORLD_SIZE = "world_size"
    """The number of processes that wrote it (the resume check compares the step's packs)."""
    RUN = "run"
    """`RunState.to_dict()`: step, data position, skip and spike counts, losses so far."""
    SCHEDULER = "scheduler"
    RNG = "rng"
    """Every rank's RNG states (`state.capture_rng`), rank 0's first."""
    RECIPE = "recipe"
    """The resolved recipe (the resume check compares it)."""
    DATA = "data"
    """The training packs the data position counts in: `{"packs": n, "digest": packs_digest}` (the
    resume check compares it; None for a run built without data)."""


# --------------------------------------------------------------------------------------------------
# save and restore


def save_checkpoint(run: Run) -> Path:
    """A checkpoint of the whole run at this step (every rank takes part): the model in Hugging Face
    format (gathered on rank 0 when sharded), the optimizer state through
    `torch.distributed.checkpoint` (sharded: each rank writes its part, and any world size reads it
    back) and the trainer state. Returns the checkpoint's folder."""
    check_finite_weights(run)
    model_state, heads_state = gathered_states(run)
    optimizer_state = portable_optimizer_state(run)
    trainer_state = {
        TrainerState.FORMAT: FORMAT,
        TrainerState.WORLD_SIZE: run.topology.world_size,
        TrainerState.RUN: run.state.to_dict(),
        TrainerState.SCHEDULER: run.scheduler.state_dict(),
        TrainerState.RNG: gather_objects(capture_rng()),
        TrainerState.RECIPE: run.recipe.to_dict(),
        TrainerState.DATA: ({"packs": len(run.data.train_packs), "digest": run.data.train_digest}
                            if run.data is not None else None),
    }

    def write(folder: Path) -> None:
        with written(run.output_dir, "checkpoint"):
            with one_process_is_intended():
                dcp.save({"optimizer": optimizer_state}, checkpoint_id=folder / OPTIMIZER,
                         no_dist=not run.topology.distributed)
            save_model_files(folder, run, model_state, heads_state)
            if run.topology.is_main:
                torch.save(trainer_state, folder / TRAINER_STATE)

    return publish_checkpoint(run.output_dir, run.state.step, write, keep=run.recipe.train.keep_checkpoints)


def restore_checkpoint(run: Run, checkpoint: Path, saved: dict) -> None:
    """Continue from `checkpoint` (`saved`: its trainer state): optimizer, schedule, run state and
    RNG as they were, at this world size or another. The weights were loaded before the model was
    sharded (`load_model_weights`)."""
    load_optimizer_state(run, checkpoint / OPTIMIZER)
    run.scheduler.load_state_dict(saved[TrainerState.SCHEDULER])
    # Format 1 kept the last loss and the held-out losses beside the run state.
    earlier = {key: saved[key] for key in ("last_loss", "eval_losses") if key in saved}
    run.state = RunState.from_dict({**earlier, **saved[TrainerState.RUN]})
    rngs = saved[TrainerState.RNG]
    same_world = len(rngs) == run.topology.world_size
    restore_rng(rngs[run.topology.rank] if same_world else rngs[0])  # last: building drew from them


def save_final(run: Run) -> Path:
    """The model at the end of the run, in `final/`."""
    check_finite_weights(run)
    model_state, heads_state = gathered_states(run)

    def write(folder: Path) -> None:
        with written(run.output_dir, "final model"):
            save_model_files(folder, run, model_state, heads_state)

    return write_atomic_dir(run.output_dir / "final", write)


def save_pretrained(folder: Path, model: Any, tokenizer: Any, *, state_dict: dict | None = None) -> None:
    """The model (or its peft adapters) and the tokenizer in Hugging Face format, written by rank 0;
    `state_dict` is the whole model's, gathered on rank 0 from a sharded model."""
    if is_main_process():
        model.save_pretrained(folder, **({"state_dict": state_dict} if state_dict is not None else {}))
        tokenizer.save_pretrained(folder)


def save_model_files(folder: Path, run: Run, model_state: dict | None, heads_state: dict | None) -> None:
    """What a checkpoint or final/ holds of the model, written by rank 0: the model (or its
    adapters) and the tokenizer (`save_pretrained`), and the Medusa heads of the loss head beside
    them. Heads trained over a frozen model are saved alone, with the tokenizer and `base_model.json`
    naming the recipe's model: that model is the starting one, unchanged, and the run's recipe
    rebuilds it (`load_base_model`)."""
    heads = run.head.medusa
    if heads is None or run.head.frozen_backbone is False:
        save_pretrained(folder, run.model, run.tokenizer, state_dict=model_state)
    if heads is None or not is_main_process():
        return
    save_heads(heads, folder, state=heads_state)
    if run.head.frozen_backbone:
        run.tokenizer.save_pretrained(folder)
        save_base_note(folder, run.recipe.model.name_or_path)


def gathered_states(run: Run) -> tuple[dict | None, dict | None]:
    """The whole model's weights and the Medusa heads' on rank 0's CPU when the model is sharded
    (None otherwise: each saves itself). A weight tied to another (embeddings and output projection)
    is kept once, under its first name, as one process saves it: the same model is the same files
    whatever the world size."""
    if not run.topology.distributed:
        return None, None
    state = get_model_state_dict(run.head, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not run.topology.is_main:
        return None, None
    prefix, heads_prefix = "model.", "medusa."  # the head holds the model as `self.model`, the heads as `self.medusa`
    tied = tied_names(run.model)
    model = {k[len(prefix):]: v for k, v in state.items()
             if k.startswith(prefix) and k[len(prefix):] not in tied}
    heads = {k[len(heads_prefix):]: v for k, v in state.items() if k.startswith(heads_prefix)}
    return model, heads or None


def tied_names(model: nn.Module) -> set[str]:
    """The names of parameters that share their tensor with a parameter named before them."""
    first: dict[int, str] = {}
    later = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            later.add(name)
        else:
            first[id(p)] = name
    return later


def load_optimizer_state(run: Run, folder: Path) -> None:
    """The optimizer state of a checkpoint, resharded to this run's processes. A float32 master the
    checkpoint lacks (written by a run that kept none, or before FSDP's were saved) is made again from
    the weights, as at the start of a run."""
    state = {"optimizer": portable_optimizer_state(run)}
    saved = set(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    for name, entry in state["optimizer"]["state"].items():
        if MASTER in entry and f"optimizer.state.{name}.{MASTER}" not in saved:
            del entry[MASTER]
    with one_process_is_intended():
        dcp.load(state, checkpoint_id=folder, no_dist=not run.topology.distributed)
    if masters_are_parameters(run):  # loaded into the parameters themselves
        for entry in state["optimizer"]["state"].values():
            entry.pop(MASTER, None)
    set_optimizer_state_dict(run.head, run.optimizer, state["optimizer"])


def portable_optimizer_state(run: Run) -> dict:
    """The optimizer state as a checkpoint holds it, alike at every world size: with
    `optim.master_weights`, the float32 master of each trainable parameter the forward computes in
    16 bits under `master` (`training.precision`). One process keeps it in the optimizer state; FSDP's
    mixed precision keeps it as the sharded float32 parameter itself (`training.build.fsdp_dtypes`),
    which is put under that key here, so that a checkpoint of either resumes on the other with the
    same float32 weights."""
    state = get_optimizer_state_dict(run.head, run.optimizer)
    if masters_are_parameters(run):
        params = dict(run.head.named_parameters())
        for name, entry in state["state"].items():
            if name in params:  # shares the parameter's storage: a load writes into the parameter
                entry[MASTER] = params[name].detach()
    return state


def masters_are_parameters(run: Run) -> bool:
    """Whether the run's trainable parameters are float32 masters of 16-bit computation under FSDP."""
    from ligertune.training.build import fsdp_dtypes, strategy

    sharded = run.topology.distributed and strategy(run.recipe) == "fsdp"
    dtypes = fsdp_dtypes(run.recipe, run.device.type, sharded=sharded)
    return run.recipe.optim.master_weights and dtypes.compute is not None


def load_heads_weights(heads: nn.Module, checkpoint: Path) -> None:
    """Put the checkpoint's Medusa heads into `heads` (`training.build.build_medusa_heads`) in place."""
    if not (checkpoint / HEADS_FILE).is_file():
        raise UserError(f"--resume: {checkpoint} holds no Medusa heads ({HEADS_FILE}) for the recipe's")
    saved = load_heads(checkpoint)
    if saved.config != heads.config:
        raise UserError(f"--resume: the Medusa heads in {checkpoint} ({saved.config}) do not fit the recipe's "
                        f"({heads.config})")
    heads.load_state_dict(saved.state_dict())  # copied into the heads' own tensors, in their dtype


def load_model_weights(model: nn.Module, checkpoint: Path) -> None:
    """Put the checkpoint's weights (the LoRA adapters, or the whole model) into `model` in place."""
    from safetensors.torch import load_file

    adapters = checkpoint / "adapter_model.safetensors"
    if adapters.is_file():
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_file(adapters))
        if getattr(result, "unexpected_keys", None):
            raise UserError(f"--resume: {adapters} does not fit the recipe's adapters "
                            f"(unexpected {result.unexpected_keys[0]})")
        return
    files = sorted(checkpoint.glob("model*.safetensors"))
    if not files:
        raise UserError(f"--resume: {checkpoint} holds no model weights (model*.safetensors)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    missing, unexpected = model.load_state_dict(state, strict=False)
    untied = [key for key in missing if not _is_tied(model, key, state)]
    if unexpected or untied:
        key = (unexpected or untied)[0]
        raise UserError(f"--resume: the weights in {checkpoint} do not fit the recipe's model ({key})")


def _is_tied(model: nn.Module, key: str, loaded: dict[str, torch.Tensor]) -> bool:
    """Whether parameter `key` shares its tensor with one that was loaded (tied embeddings)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    target = params.get(key)
    return target is not None and any(p is target for name, p in params.items() if name in loaded)


def check_finite_weights(run: Run) -> None:
    """No file the run writes may hold a NaN or infinite weight (checked on every shard)."""
    local = [(p.detach().to_local() if hasattr(p, "to_local") else p.detach()) for p in run.trainable]
    broken = torch.stack([(~t.isfinite()).any() for t in local]).any().double()
    if all_reduce_max(broken).item():
        raise TrainingDiverged(f"step {run.state.step}: a trainable weight is not finite; nothing was saved")


@contextlib.contextmanager
def one_process_is_intended() -> Iterator[None]:
    """`torch.distributed.checkpoint` warns whenever it runs without a process group, even when
    asked to; a run of one process asks to."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@contextlib.contextmanager
def written(run_dir: Path, what: str) -> Iterator[None]:
    """Turn a failed write (full disk, a file-size limit, permissions) into one line naming the path
    and the cause; the temporary files are gone already and the previous checkpoint is intact."""
    try:
        yield
    except (Exception, CheckpointException) as err:  # the distributed writer's is a BaseException
        cause = write_failure(err)
        if cause is None:
            raise
        latest = latest_checkpoint(run_dir)
        kept = f"; the last checkpoint {latest} is intact" if latest else ""
        raise EnvironmentFault(f"cannot write the {what} in {run_dir}{cause}{write_limits(run_dir)}{kept}") from None


def write_limits(folder: Path) -> str:
    """What may have stopped a write: the free space where it wrote, and a file-size limit."""
    try:
        found = [f"{shutil.disk_usage(folder).free / 2**20:,.0f} MiB free there"]
    except OSError:
        found = []
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        found.append(f"files limited to {limit:,} bytes (ulimit -f)")
    return f" ({', '.join(found)})" if found else ""


def write_failure(err: BaseException) -> str | None:
    """What a failed write says (": cause", with the file where known), or None for an error of
    another kind. The distributed writer wraps each rank's error; torch's writer raises a
    RuntimeError without the system's reason, safetensors' names the OS error's code."""
    if isinstance(err, CheckpointException):
        causes = [e for e, _ in err.failures.values() if write_failure(e) is not None]
        return write_failure(causes[0]) if causes else None
    if isinstance(err, OSError):
        where = f" ({err.filename})" if err.filename else ""
        return f"{where}: {err.strerror or err}"
    text = str(err)
    code = re.search(r"Os \{ code: (\d+)", text)
    if code:
        return f": {os.strerror(int(code.group(1)))}"
    if any(sign in text for sign in ("file write failed", "failed writing", "unexpected pos")):
        return ": a file write failed"
    return None


# --------------------------------------------------------------------------------------------------
# the checkpoints of a run folder


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def checkpoint_steps(folder: Path) -> list[tuple[int, Path]]:
    """The checkpoints under `folder` (`step-*` directories), oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir() and not path.is_symlink():
            found.append((int(match.group(1)), path))
    return sorted(found)


def publish_checkpoint(run_dir: Path, step: int, write: Callable[[Path], None], *, keep: int) -> Path:
    """Write checkpoint `step` with `write(folder)` (on every rank), point `latest` at it, then remove
    the oldest checkpoints beyond `keep`."""
    folder = run_dir / CHECKPOINTS
    target = write_atomic_dir(folder / checkpoint_name(step), write)
    if is_main_process():
        point_latest(folder, target.name)
        for _, old in checkpoint_steps(folder)[:-keep]:
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
    barrier()
    return target


def point_latest(folder: Path, name: str) -> None:
    """Make `folder/latest` a link to `name`, replacing the old link in one rename."""
    tmp = folder / f".{LATEST}.tmp-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(name, tmp)
    try:
        os.replace(tmp, folder / LATEST)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(folder)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `latest` points at, if it has its trainer state."""
    link = run_dir / CHECKPOINTS / LATEST
    if not link.is_symlink():
        return None
    target = link.resolve()
    return target if (target / TRAINER_STATE).is_file() else None


def load_trainer_state(checkpoint: Path) -> dict:
    """The trainer state of `checkpoint`; `DamagedFile` (a user error naming the file) when it is
    cut short, garbage, or holds what a safe load refuses."""
    saved = load_torch_file(checkpoint / TRAINER_STATE)
    if not isinstance(saved, dict) or not {TrainerState.RUN, TrainerState.RECIPE} <= saved.keys():
        raise DamagedFile(checkpoint / TRAINER_STATE, "not a ligertune trainer state")
    return saved


def verify_checkpoint(checkpoint: Path) -> dict:
    """Check every file of `checkpoint` that a resume reads, before anything is built from it, and
    return its trainer state: the trainer state loads, each weights file's header and sizes are
    whole, the optimizer state has its metadata. Raises `DamagedFile` naming the first bad file."""
    saved = load_trainer_state(checkpoint)
    weights = sorted(checkpoint.glob("adapter_model.safetensors")) or sorted(checkpoint.glob("model*.safetensors"))
    weights += sorted(checkpoint.glob(HEADS_FILE))  # Medusa heads: beside the model, or alone over a frozen one
    if not weights:
        raise DamagedFile(checkpoint, "no model weights (model*.safetensors, adapter_model.safetensors or "
                                      f"{HEADS_FILE})")
    for file in weights:
        check_safetensors(file)
    metadata = checkpoint / OPTIMIZER / ".metadata"
    if not metadata.is_file() or metadata.stat().st_size == 0:
        raise DamagedFile(metadata, "missing or empty (the optimizer state's index)")
    for file in (checkpoint / OPTIMIZER).iterdir():
        if file.is_file() and file.stat().st_size == 0:
            raise DamagedFile(file, "empty (a file of the optimizer state)")
    return saved


def find_checkpoint(run_dir: Path, resume: str | Path, *, notice: Callable[[str], None]) -> tuple[Path, dict]:
    """The checkpoint to continue from, verified, and its trainer state: `latest` of the run
    directory, or the given checkpoint or run directory. A damaged checkpoint named on the command
    line is refused; a damaged `latest` gives way to the newest complete one, with a `notice`
    naming what was passed over."""
    path = run_dir if str(resume) == "latest" else Path(resume).expanduser()
    if path.is_dir() and (path / TRAINER_STATE).exists():
        try:
            return path.resolve(), verify_checkpoint(path)
        except DamagedFile as err:
            raise UserError(f"--resume: the checkpoint is damaged: {err}") from None
    candidates = [p for _, p in reversed(checkpoint_steps(path / CHECKPOINTS))]
    latest = (path / CHECKPOINTS / LATEST)
    if latest.is_symlink() and latest.resolve() in candidates:  # `latest` first, then the newest
        candidates.remove(latest.resolve())
        candidates.insert(0, latest.resolve())
    damaged = []
    for checkpoint in candidates:
        try:
            saved = verify_checkpoint(checkpoint)
        except DamagedFile as err:
            damaged.append(str(err))
            continue
        if damaged:
            notice(f"--resume: passed over {len(damaged)} damaged checkpoint{'s' * (len(damaged) > 1)} "
                   f"({'; '.join(damaged)}); resuming from {checkpoint}")
        return checkpoint, saved
    if damaged:
        raise UserError(f"--resume: every checkpoint in {path / CHECKPOINTS} is damaged, the newest: {damaged[0]}")
    if str(resume) == "latest":
        raise UserError(f"--resume: no checkpoint in {path / CHECKPOINTS} to resume from "
                        "(train.save_every writes them)")
    raise UserError(f"--resume: {resume} is not a checkpoint (no {TRAINER_STATE}) nor a run directory "
                    "with checkpoints")


def remove_stale_temporaries(run_dir: Path) -> None:
    """Temporary directories and links left by a process that was killed mid-write."""
    for folder in (run_dir, run_dir / CHECKPOINTS):
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            if path.name.startswith(".") and (".tmp-" in path.name or ".old-" in path.name):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
