"""mixprec.save / mixprec.load: atomic writes, safe and validated loads, bit-identical resume after a crash."""

from __future__ import annotations

import io
import os
import re
import signal
import struct
import subprocess
import sys
import textwrap
import warnings
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from _trees import equal_tree  # tests/_trees.py
from torch import nn

import mixprec._checkpoint as ckpt
from mixprec._checkpoint import FORMAT, CheckpointError, load, save
from mixprec._precision import MixedPrecision

PRESETS = ["fp16-master", "bf16-master-r16", "bf16-pure", "bf16-mixed"]


# ----- a tiny deterministic training run -------------------------------------------------------------
def make(preset: str, seed: int = 0) -> tuple[MixedPrecision, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    prec = MixedPrecision(preset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on CPU is slow: known
        model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    return prec, model, opt


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 8, generator=g)
    return x, x[:, :4].argmax(1)


def train(prec, model, opt, start, stop, path=None, every=10):
    """Steps [start, stop); every 7th step is poisoned with inf (skipped); checkpoints every ``every`` steps."""
    losses = []
    for s in range(start, stop):
        x, y = batch(s)
        with prec.autocast():
            loss = nn.functional.cross_entropy(model(x).float(), y)
        prec.backward(loss * (float("inf") if s % 7 == 3 else 1.0))
        prec.step(opt)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if path is not None and (s + 1) % every == 0:
            save({**prec.state_dict(), "step": s + 1}, path)
    return losses



@pytest.fixture
def trained(tmp_path):
    prec, model, opt = make("fp16-master")
    train(prec, model, opt, 0, 5)
    path = tmp_path / "ckpt.pt"
    save(prec.state_dict(), path)
    return prec, model, opt, path


# ----- round trip and format ------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_round_trip_is_exact_and_marked(preset, tmp_path):
    prec, model, opt = make(preset)
    train(prec, model, opt, 0, 5)
    path = tmp_path / "c.pt"
    save({**prec.state_dict(), "epoch": 3, "data": {"position": 17, "files": ["a", "b"]}}, path)
    raw = torch.load(path, weights_only=True)
    assert raw["format"] == FORMAT and raw["format_version"] == 1 and raw["checksum"]["algorithm"] == "crc32-v2"
    state = load(path, expected_policy=preset)
    assert state["epoch"] == 3 and state["data"] == {"position": 17, "files": ["a", "b"]}
    assert equal_tree({k: v for k, v in state.items() if k not in ("epoch", "data")}, prec.state_dict())
    prec.load_state_dict(state)


def test_low_bit_optimizer_states_of_torchao_save_load_and_resume_exactly(tmp_path):
    """Tensor subclasses registered for weights_only loading (torchao's 8-bit AdamW states) are saved and checksummed
    through their inner tensors; a changed byte in one of them fails the check."""
    optim = pytest.importorskip("torchao.optim")

    def run() -> tuple[MixedPrecision, nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 4))  # torchao quantizes states of >= 4096 elements
        prec = MixedPrecision("bf16-master")
        model, opt = prec.prepare(model, optim.AdamW8bit(model.parameters(), lr=1e-3))
        return prec, model, opt

    def step(prec, model, opt, s):
        x = torch.Generator().manual_seed(s)
        with prec.autocast():
            loss = model(torch.randn(8, 256, generator=x)).float().square().mean()
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad()

    prec, model, opt = run()
    for s in range(2):
        step(prec, model, opt, s)
    state = prec.state_dict()
    exp_avg = next(v["exp_avg"] for v in state["optimizers"][0]["optimizer"]["state"].values() if v["exp_avg"].numel() > 4096)
    assert type(exp_avg).__name__ == "OptimState8bit"
    path = tmp_path / "ckpt.pt"
    save(state, path)
    prec2, model2, opt2 = run()
    prec2.load_state_dict(load(path))
    for s in range(2, 4):
        step(prec, model, opt, s)
        step(prec2, model2, opt2, s)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)

    envelope = torch.load(path, weights_only=True)
    inner = next(v["exp_avg"] for v in envelope["state"]["optimizers"][0]["optimizer"]["state"].values()
                 if v["exp_avg"].numel() > 4096)
    inner.codes.view(-1)[0] ^= 1
    torch.save(envelope, path)
    with pytest.raises(CheckpointError, match="checksum"):
        load(path)


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp16-mixed"])
def test_a_run_with_lazy_modules_resumes_into_a_fresh_unmaterialised_run(preset, tmp_path):
    """Lazy modules are accepted under '*-mixed'; the fresh run's load materialises them, as torch's load does (the shape
    check read an uninitialised parameter's shape: torch's RuntimeError)."""

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.LayerNorm(16), nn.LazyLinear(3))
        prec = MixedPrecision(preset)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        return prec, model, opt

    def step(prec, model, opt, s):
        x, y = batch(s)
        with prec.autocast():
            loss = nn.functional.cross_entropy(model(x).float(), y[:] % 3)
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad()

    prec, model, opt = build()
    for s in range(2):
        step(prec, model, opt, s)
    save(prec.state_dict(), tmp_path / "lazy.pt")
    prec2, model2, opt2 = build()
    prec2.load_state_dict(load(tmp_path / "lazy.pt"))
    for s in range(2, 4):
        step(prec, model, opt, s)
        step(prec2, model2, opt2, s)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    prec3, model3, _ = build()
    prec3.load_model_state_dict({k: v.float() for k, v in model.state_dict().items()})
    assert model3[0].weight.shape == (16, 8)


def test_bf16_pure_optimizer_state_loaded_before_prepare_keeps_its_compensation():
    """nanoGPT's resume order: model and torch optimizer loaded from the checkpoint, then prepare. prepare reseeded the
    compensation from the (already half) weights: zero, the loaded remainders lost silently."""

    def fresh():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3)

    model, opt = fresh()
    prec = MixedPrecision("bf16-pure")
    model, opt = prec.prepare(model, opt)
    train(prec, model, opt, 0, 4)
    buf = io.BytesIO()
    torch.save(prec.state_dict(), buf)  # (a copy: the state dict's tensors are the live ones)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert any(int(st["kahan_comp"].count_nonzero()) for st in state["optimizers"][0]["state"].values())

    model2, opt2 = fresh()
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optimizers"][0])
    prec2 = MixedPrecision("bf16-pure")
    model2, opt2 = prec2.prepare(model2, opt2)
    train(prec, model, opt, 4, 7)
    train(prec2, model2, opt2, 4, 7)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_save_accepts_the_mixed_precision_object_and_pathlike(trained, tmp_path):
    prec, _, _, _ = trained
    save(prec, str(tmp_path / "a.pt"))
    assert equal_tree(load(tmp_path / "a.pt"), prec.state_dict())


def test_plain_torch_save_of_a_state_dict_loads(trained, tmp_path):
    prec, _, _, _ = trained
    torch.save(prec.state_dict(), tmp_path / "plain.pt")
    assert equal_tree(load(tmp_path / "plain.pt"), prec.state_dict())


def test_permissions_are_kept(trained):
    prec, _, _, path = trained
    os.chmod(path, 0o600)
    save(prec.state_dict(), path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    umask = os.umask(0)
    os.umask(umask)
    fresh = path.with_name("fresh.pt")
    save(prec.state_dict(), fresh)
    assert os.stat(fresh).st_mode & 0o777 == 0o666 & ~umask


def test_expected_policy(trained):
    prec, _, _, path = trained
    assert load(path, expected_policy="p=f16,c=f16,m=f32,o=f32")["policy"] == str(prec.policy)
    msg = ("was saved under policy 'p=f16,c=f16,o=f32,m=f32,ls=dynamic,i=norm,tf32=0,comp=none' but "
           "'p=bf16,c=bf16,o=f32,m=f32,ls=none,i=norm,tf32=0,comp=none' was expected; convert it with "
           "mixprec.checkpoint.convert_state_dict(state, 'bf16-master')")
    with pytest.raises(CheckpointError, match=re.escape(msg)):
        load(path, expected_policy="bf16-master")


# ----- crashes while saving -------------------------------------------------------------------------
def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


@pytest.mark.parametrize("where", ["write", "fsync", "replace"])
def test_crash_during_save_keeps_the_previous_checkpoint(trained, monkeypatch, where):
    prec, model, opt, path = trained
    old = load(path)
    old_bytes = path.read_bytes()
    train(prec, model, opt, 5, 8)  # the state moves on
    real_save = torch.save

    def half_write(obj, f):  # writes half the file, then the "disk" fails
        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        raise OSError(28, "No space left on device")

    def boom(*a, **k):
        raise OSError(5, "Input/output error")

    if where == "write":
        monkeypatch.setattr(ckpt.torch, "save", half_write)
    elif where == "fsync":
        monkeypatch.setattr(ckpt.os, "fsync", boom)
    else:
        monkeypatch.setattr(ckpt.os, "replace", boom)
    with pytest.raises(OSError):
        save(prec.state_dict(), path)
    monkeypatch.undo()
    assert path.read_bytes() == old_bytes
    assert equal_tree(load(path), old)
    assert _leftovers(path.parent) == []  # the temporary file was removed


def test_keyboard_interrupt_during_save_cleans_up(trained, monkeypatch):
    prec, _, _, path = trained
    old_bytes = path.read_bytes()

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.os, "replace", interrupt)
    with pytest.raises(KeyboardInterrupt):
        save(prec.state_dict(), path)
    assert path.read_bytes() == old_bytes and _leftovers(path.parent) == []


_CHILD = textwrap.dedent(
    """
    import os, sys, io, time
    sys.path.insert(0, {tests!r})
    import torch
    torch.set_num_threads(1)
    import test_checkpoint as t
    import mixprec._checkpoint as ckpt
    real_save, calls = torch.save, []
    def dying_save(obj, f):
        calls.append(1)
        if len(calls) < 3:
            return real_save(obj, f)
        buf = io.BytesIO(); real_save(obj, buf)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2]); f.flush(); os.fsync(f.fileno())
        print("KILL ME", flush=True)
        time.sleep(120)
    ckpt.torch.save = dying_save
    prec, model, opt = t.make("fp16-master")
    t.train(prec, model, opt, 0, 40, path={path!r})
    print("NOT KILLED", flush=True)
    """
)


def test_killed_process_mid_save_then_resume_is_bit_identical(tmp_path):
    """A process killed (SIGKILL) while writing its 3rd checkpoint: the 2nd survives and resumes bit for bit."""
    path = tmp_path / "ckpt.pt"
    code = _CHILD.format(tests=str(Path(__file__).parent), path=str(path))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        line = child.stdout.readline()  # type: ignore[union-attr]
        assert line.strip() == "KILL ME", (line, child.stderr.read() if child.poll() is not None else "")  # type: ignore[union-attr]
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert len(_leftovers(tmp_path)) == 1  # the half-written temporary file; the checkpoint is untouched
    state = load(path, expected_policy="fp16-master")
    assert state["step"] == 20
    # resume in a fresh run (another init: everything must come from the checkpoint)
    prec, model, opt = make("fp16-master", seed=123)
    prec.load_state_dict(state)
    resumed = train(prec, model, opt, 20, 40)
    ref_prec, ref_model, ref_opt = make("fp16-master")
    ref = train(ref_prec, ref_model, ref_opt, 0, 40)
    assert resumed == ref[20:]
    assert equal_tree(prec.state_dict(), ref_prec.state_dict())
    # the next save to the same path deletes the dead process's temporary file
    save(prec.state_dict(), path)
    assert _leftovers(tmp_path) == []
    assert equal_tree(load(path), prec.state_dict())


def test_next_save_keeps_temporaries_of_live_processes_and_other_hosts(trained):
    prec, _, _, path = trained
    d = path.parent
    live = d / f".{path.name}.{ckpt._host()}.{os.getppid()}.abc.tmp"  # our parent is alive: a concurrent writer
    other_host = d / f".{path.name}.otherhost.1.abc.tmp"
    other_file = d / f".other.pt.{ckpt._host()}.999999999.abc.tmp"  # a dead PID, but another checkpoint's file
    dead = d / f".{path.name}.{ckpt._host()}.999999999.abc.tmp"
    for f in (live, other_host, other_file, dead):
        f.write_bytes(b"partial")
    save(prec.state_dict(), path)
    assert not dead.exists()
    assert live.exists() and other_host.exists() and other_file.exists()


@pytest.mark.parametrize("preset", PRESETS)
def test_resume_after_failed_save_is_bit_identical(preset, tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    prec, model, opt = make(preset)
    train(prec, model, opt, 0, 20, path=path)  # checkpoints at 10 and 20
    calls = []

    def crash(*a, **k):
        calls.append(1)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(ckpt.os, "replace", crash)
    with pytest.raises(OSError):
        train(prec, model, opt, 20, 30, path=path)  # the save at 30 fails: the "process dies"
    monkeypatch.undo()
    assert calls == [1]
    state = load(path, expected_policy=preset)
    assert state["step"] == 20
    prec2, model2, opt2 = make(preset, seed=7)
    prec2.load_state_dict(state)
    resumed = train(prec2, model2, opt2, 20, 40)
    ref_prec, ref_model, ref_opt = make(preset)
    ref = train(ref_prec, ref_model, ref_opt, 0, 40)
    assert resumed == ref[20:]
    assert equal_tree(prec2.state_dict(), ref_prec.state_dict())


# ----- broken files ---------------------------------------------------------------------------------
def test_truncated_files_give_a_clear_error(trained):
    _, _, _, path = trained
    data = path.read_bytes()
    bad = path.with_name("bad.pt")
    for n in (1, 4, 100, len(data) // 3, len(data) // 2, len(data) - 30, len(data) - 1):
        bad.write_bytes(data[:n])
        with pytest.raises(CheckpointError, match=re.escape(f"cannot read the checkpoint {str(bad)!r} ({n} bytes)")) as e:
            load(bad)
        assert "Use an earlier checkpoint" in str(e.value)
        if n >= 4:
            assert "it is a PyTorch (zip) file but truncated or corrupted" in str(e.value)
    bad.write_bytes(b"")
    with pytest.raises(CheckpointError, match=re.escape("is empty (0 bytes): it was cut short while being written")):
        load(bad)


def test_flipped_bits_are_caught_by_the_checksum(trained):
    prec, model, _, path = trained
    data = path.read_bytes()
    # a bit in a tensor: torch itself would load it silently
    weight = model[3].weight.detach().contiguous()
    needle = bytes(ctypes_buffer(weight))
    at = data.find(needle)
    assert at > 0
    corrupt = bytearray(data)
    corrupt[at + 5] ^= 0x10
    bad = path.with_name("bad.pt")
    bad.write_bytes(bytes(corrupt))
    torch.load(bad, weights_only=True)  # torch does not notice
    with pytest.raises(CheckpointError, match=re.escape("is corrupted: its contents do not match the checksum")):
        load(bad)
    load(bad, verify=False)  # the escape hatch
    # a bit in a number inside the pickle (the learning rate)
    lr = struct.pack(">d", 3e-3)
    assert data.count(lr) == 1
    bad.write_bytes(data.replace(lr, struct.pack(">d", 3e-2)))
    with pytest.raises(CheckpointError, match=re.escape("is corrupted")):
        load(bad)


def test_every_flipped_byte_of_the_pickle_is_refused_or_harmless(tmp_path):
    """Each byte of data.pkl flipped (one bit) in turn: the load is refused, or loads a state equal to the saved one.

    Before containers were in the checksum, a flip could rename a key whose value is an empty dict
    (``"tied": {}`` loaded as ``"uied"``) without an error.
    """
    import zipfile

    prec, model, opt = make("bf16-mixed")  # no tied weights: "tied" is an empty dict
    train(prec, model, opt, 0, 2)
    path = tmp_path / "small.pt"
    save(prec.state_dict(), path)
    want = load(path)
    assert want["tied"] == {}
    data = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    assert info.compress_type == zipfile.ZIP_STORED
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])  # local header
    start = info.header_offset + 30 + name_len + extra_len
    assert data[start] == 0x80  # the pickle's PROTO opcode: the member's first byte
    bad = tmp_path / "bad.pt"
    refused = harmless = 0
    for i in range(start, start + info.compress_size):
        corrupt = bytearray(data)
        corrupt[i] ^= 0x01
        bad.write_bytes(bytes(corrupt))
        try:
            got = load(bad)
        except CheckpointError:
            refused += 1
            continue
        assert equal_tree(got, want), f"byte {i - start} of data.pkl flipped: a different state loaded without an error"
        harmless += 1
    assert refused > 0.5 * info.compress_size and harmless > 0  # (harmless: e.g. the informational torch_version)


def ctypes_buffer(t: torch.Tensor) -> bytes:
    buf, _ = ckpt._tensor_bytes(t)
    return bytes(buf)


def test_garbage_and_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape("mixprec.load: no checkpoint at")):
        load(tmp_path / "nope.pt")
    for content in (b"hello, I am a text file\n" * 20, bytes(range(256)) * 8):
        f = tmp_path / "garbage.pt"
        f.write_bytes(content)
        with pytest.raises(CheckpointError, match=re.escape("it is truncated, corrupted, or not a file written by torch.save")):
            load(f)
    with pytest.raises(TypeError, match=re.escape("needs a file path (str or os.PathLike), got BytesIO")):
        load(io.BytesIO())  # type: ignore[arg-type]


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned_by_checkpoint",))


def test_pickled_code_is_never_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save({"version": 1, "payload": _Evil()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match=re.escape("refusing to load")) as e:
        load(tmp_path / "evil.pt")
    assert "could run code from the file" in str(e.value) and "GLOBAL posix.system" in str(e.value)
    assert not (tmp_path / "pwned_by_checkpoint").exists()


def test_foreign_and_newer_files(trained, tmp_path):
    prec, model, opt, path = trained
    cases = [
        (model.state_dict(), "it holds a model state dict"),
        (opt.optimizer.state_dict(), "it holds a plain optimizer state dict"),
        ([1, 2, 3], "it holds a list, not a mixprec checkpoint dict"),
        ({"epoch": 1}, "it has no mixprec format marker (keys ['epoch'])"),
    ]
    f = tmp_path / "foreign.pt"
    for obj, msg in cases:
        torch.save(obj, f)
        with pytest.raises(CheckpointError, match=re.escape(f"{str(f)!r} is not a mixprec checkpoint: {msg}")):
            load(f)
    raw = torch.load(path, weights_only=True)
    torch.save({**raw, "format_version": 2, "mixprec_version": "9.0"}, f)
    with pytest.raises(CheckpointError, match=re.escape("has format version 2 (written by mixprec 9.0); this mixprec")):
        load(f)
    state = dict(raw["state"])
    state["version"] = 99
    torch.save(state, f)
    with pytest.raises(CheckpointError, match=re.escape("does not hold a valid mixprec state: mixprec state version 99")):
        load(f)
    state["version"] = 1
    state["policy"] = "p=f99"
    torch.save(state, f)
    with pytest.raises(CheckpointError, match=re.escape("the state's policy 'p=f99' is not valid for this mixprec")):
        load(f)


def test_save_refuses_what_could_not_be_loaded(trained, tmp_path):
    prec, model, _, path = trained
    sd = prec.state_dict()
    Point = namedtuple("Point", "x y")
    cases = [
        ({**sd, "extra": object()}, TypeError, "state['extra'] is a object, which torch.load(weights_only=True) refuses"),
        ({**sd, "extra": Point(1, 2)}, TypeError, "state['extra'] is a Point; torch.load(weights_only=True) accepts plain"),
        ({**sd, "extra": {"a": {1, 2}}}, TypeError, "state['extra']['a'] is a set"),
        (model.state_dict(), ValueError, "It looks like a model state dict"),
        ([1], TypeError, "mixprec.save(state, path) needs the dict MixedPrecision.state_dict() returns, got list"),
        ({**sd, "policy": "nonsense"}, CheckpointError, "save(): the state's policy 'nonsense' is not valid"),
    ]
    before = path.read_bytes()
    for state, exc, msg in cases:
        with pytest.raises(exc, match=re.escape(msg)):
            save(state, path)
    assert path.read_bytes() == before and _leftovers(path.parent) == []
    with pytest.raises(FileNotFoundError, match=re.escape("does not exist; create it first")):
        save(sd, tmp_path / "no" / "such" / "dir.pt")
    with pytest.raises(TypeError, match=re.escape("needs a file path")):
        save(sd, io.BytesIO())  # type: ignore[arg-type]


@pytest.mark.parametrize("preset", ["bf16-master", "fp16-mixed"])
def test_a_state_dict_without_the_optimizer_state_of_a_run_that_stepped_warns(preset, tmp_path):
    """torch.distributed.checkpoint fills only a template's entries: a template taken before the first step has no
    optimizer state, so the saved AdamW moments are never read. load_state_dict says so instead of silently starting
    the moments afresh; a normal resume says nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on a CPU
        prec, model, opt = make(preset)
        train(prec, model, opt, 0, 3)
        full = prec.state_dict()
        fresh, fresh_model, fresh_opt = make(preset)
    template = fresh.state_dict()  # before any step: no optimizer state entries
    template["applied_steps"] = full["applied_steps"].clone()  # what dcp.load fills in
    template["model"] = {k: v.clone() for k, v in full["model"].items()}
    with pytest.warns(UserWarning, match=r"optimizer 0 \(AdamW\) loads no state .* applied 3 step\(s\)"):
        fresh.load_state_dict(template)
    again, _, _ = make(preset)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again.load_state_dict(full)  # a checkpoint with its state: silent


def test_save_and_load_refuse_a_directory_path(tmp_path) -> None:
    """A directory (or '', or 'ck.pt/') as the path: a CheckpointError naming it (a raw IsADirectoryError naming the
    temporary file after writing it; 'ck.pt/' silently wrote 'ck.pt')."""
    import mixprec

    model = torch.nn.Linear(2, 2)
    prec = mixprec.MixedPrecision("bf16-mixed")
    prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for bad in (tmp_path, "", str(tmp_path / "ck.pt") + "/"):
        with pytest.raises(mixprec.checkpoint.CheckpointError, match="a directory|empty"):
            mixprec.save(prec.state_dict(), bad)
    with pytest.raises(mixprec.checkpoint.CheckpointError, match="a directory"):
        mixprec.load(tmp_path)
    assert list(tmp_path.iterdir()) == []


def _frozen_head_run(preset: str = "bf16-master") -> tuple[MixedPrecision, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    model[2].weight.requires_grad_(False)  # a head warmed up frozen, unfrozen during training
    prec = MixedPrecision(preset)
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return prec, model, opt


def _train_step(prec: MixedPrecision, model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with prec.autocast():
        out = model(torch.randn(8, 8, generator=g))
        loss = nn.functional.cross_entropy(out.float(), torch.randint(0, 4, (8,), generator=g))
    prec.backward(loss)
    prec.step(opt)
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("preset", ["bf16-master", "fp16-master", "bf16-master-r16"])
def test_a_layer_unfrozen_during_training_resumes_bit_exact_when_unfrozen_before_loading(preset: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prec, model, opt = _frozen_head_run(preset)
        _train_step(prec, model, opt, 0)
        model[2].weight.requires_grad_(True)
        for s in (1, 2):
            _train_step(prec, model, opt, s)
        buf = io.BytesIO()
        torch.save(prec.state_dict(), buf)  # the state dict holds live tensors, as torch's: saved before training on
        for s in (3, 4):
            _train_step(prec, model, opt, s)
        buf.seek(0)
        state = torch.load(buf, weights_only=True)
        prec2, model2, opt2 = _frozen_head_run(preset)
        model2[2].weight.requires_grad_(True)
        prec2.load_state_dict(state)
        for s in (3, 4):
            _train_step(prec2, model2, opt2, s)
    for (n, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), n
    for a, b in zip(opt.master_values(), opt2.master_values()):
        assert torch.equal(a, b)


def test_loading_masters_into_a_layer_still_frozen_names_the_fix_and_changes_nothing() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prec, model, opt = _frozen_head_run()
        _train_step(prec, model, opt, 0)
        model[2].weight.requires_grad_(True)
        _train_step(prec, model, opt, 1)
        state = prec.state_dict()
        prec2, model2, opt2 = _frozen_head_run()  # not unfrozen: the checkpoint has a master it lacks
    before = {n: p.detach().clone() for n, p in model2.named_parameters()}
    with pytest.raises(ValueError, match=r"optimizer 0: parameter 2 \(shape \(4, 16\)\) has an FP32 master in the "
                                         r"checkpoint but is frozen in this run .*requires_grad_\(True\), before loading"):
        prec2.load_state_dict(state)
    for n, p in model2.named_parameters():
        assert torch.equal(p, before[n]), n


def test_a_bf16_pure_checkpoint_of_another_optimizer_class_is_refused_before_the_model_loads() -> None:
    def run(opt_cls: type) -> tuple[MixedPrecision, nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        kwargs = {"lr": 1e-2, "momentum": 0.9} if opt_cls is torch.optim.SGD else {"lr": 1e-2}
        prec = MixedPrecision("bf16-pure")
        model, opt = prec.prepare(model, opt_cls(model.parameters(), **kwargs))
        return prec, model, opt

    prec, model, opt = run(torch.optim.AdamW)
    _train_step(prec, model, opt, 0)
    state = prec.state_dict()
    prec2, model2, _ = run(torch.optim.SGD)
    before = {n: p.detach().clone() for n, p in model2.named_parameters()}
    with pytest.raises(ValueError, match="optimizer 0: parameter group 0 of the state dict has no hyper-parameter "
                                         "'momentum', which SGD needs: a checkpoint of another optimizer class"):
        prec2.load_state_dict(state)
    for n, p in model2.named_parameters():
        assert torch.equal(p, before[n]), n


def test_optimizers_prepared_in_another_order_than_saved_are_named_as_such():
    def run(order):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        opts = [torch.optim.AdamW(model[0].parameters(), lr=1e-3), torch.optim.SGD(model[1].parameters(), lr=1e-2)]
        prec = MixedPrecision("bf16-mixed")
        prec.prepare(model, *(opts[i] for i in order))
        return prec

    state = run([0, 1]).state_dict()
    with pytest.raises(ValueError, match="same parameters as this run's but in another order"):
        run([1, 0]).load_state_dict(state)


def test_a_checkpoint_with_gradients_pending_says_once_that_they_are_not_saved():
    prec, model, opt = make("bf16-master")
    x, y = batch(0)
    for _ in range(2):
        with prec.autocast():
            loss = nn.functional.cross_entropy(model(x).float(), y)
        prec.backward(loss)  # an accumulation cycle, not stepped yet
        with pytest.warns(UserWarning, match="gradients pending .* checkpoints hold no gradients") if _ == 0 \
                else warnings.catch_warnings():
            if _:
                warnings.simplefilter("error")  # once per run
            prec.state_dict()
    prec.step(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prec.state_dict()  # at the step boundary: nothing to say
