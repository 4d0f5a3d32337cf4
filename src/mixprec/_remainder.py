"""An FP32 value as a BF16 value plus a 16-bit remainder, split and joined bit for bit.

The storage of ``bf16-master-r16``'s masters (issue 29: FP32 masters at 2 extra bytes per parameter):
a BF16 model's weight already holds the top 16 bits of its FP32 master, so 16 more bits (an
``int16`` remainder) recover the master exactly. ``split``/``join`` are the exact primitives;
:class:`RemainderBank` joins every master of a device for the step and splits it after, in a
fixed number of flat passes (``MasterWeightOptimizer(master_storage="remainder")``, ``_master.py``).

The rounding, and why it is not round-to-nearest-even: the pair (BF16 weight, remainder) must
determine the FP32 value. With ties to even, an exact tie (low 16 bits ``0x8000``) rounded down has
the remainder ``+0x8000``, outside ``int16``, and storing the low bits unsigned instead leaves the tie
ambiguous (both roundings of a tie give an even BF16 pattern). So ``split`` rounds ties away from
zero (half up on the magnitude's bit pattern): the remainder, counted in FP32 ulps of the magnitude
(``|x| = |hi| + lo * ulp``), is then always in ``[-2^15, 2^15)``.
It differs from ``tensor.to(torch.bfloat16)`` only at exact ties, 1 low-half pattern in 65,536, and
there by one BF16 ulp, away from zero. Values that round past BF16's largest finite number become
``inf`` (as ``.to(torch.bfloat16)`` does) and still join back exactly. An ``inf`` splits as itself
with a zero remainder; a NaN as BF16's quiet NaN with a zero remainder (it joins back as a NaN;
sign and payload not kept).

No host syncs: every function is elementwise tensor arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "BANK_CHUNK", "BANK_CHUNK_CPU", "RemainderBank", "join", "join_edited", "join_flat_", "join_flat_compilable_", "join_into_", "placeholder",
    "split", "split_flat_", "split_flat_compilable_", "split_into_",
]

_HALF = 0x8000
_BF16_NAN = 0x7FC0  # the quiet NaN torch's f32 -> bf16 cast gives


def _check_f32(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"{what} must be float32 (the FP32 master), got {x.dtype}; pass the FP32 value")


def _check_pair(hi: torch.Tensor, lo: torch.Tensor, full: tuple[str, torch.Tensor] | None = None) -> None:
    """Check a (BF16, int16) pair and, when given, the FP32 tensor ``full = (name, tensor)`` of its shape."""
    if full is not None:
        _check_f32(full[1], full[0])
    if not isinstance(hi, torch.Tensor) or not isinstance(lo, torch.Tensor):
        raise TypeError(f"hi and lo must be tensors, got {type(hi).__name__} and {type(lo).__name__}")
    if hi.dtype != torch.bfloat16:
        raise TypeError(f"hi must be bfloat16 (the model's weight), got {hi.dtype}")
    if lo.dtype != torch.int16:
        raise TypeError(f"lo must be int16 (the remainder split() returned), got {lo.dtype}")
    if hi.shape != lo.shape:
        raise ValueError(f"hi and lo must have the same shape, got {tuple(hi.shape)} and {tuple(lo.shape)}")
    if full is not None and full[1].shape != hi.shape:
        raise ValueError(f"{full[0]} must have hi's shape {tuple(hi.shape)}, got {tuple(full[1].shape)}")


def placeholder(like: torch.Tensor) -> torch.Tensor:
    """A remainder-stored FP32 master's data between steps: one FP32 NaN broadcast to ``like``'s shape (4 bytes).

    It keeps the shape (gradients and optimizer state attach to the master) and reads as NaN, and
    an in-place write raises (its elements share one memory location): a master read or written
    outside the step is never a silently stale value.
    """
    return torch.full((), float("nan"), dtype=torch.float32, device=like.device).expand(like.shape)


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split FP32 values into a BF16 value and an ``int16`` remainder that together are exact.

    Algorithm, on the FP32 bit pattern ``b`` (as ``int32``): the BF16 pattern is
    ``top = (b + 0x8000) >> 16``, i.e. ``(b >> 16) + (low >= 0x8000)`` with ``low = b & 0xFFFF``
    (rounding the magnitude half up, so ties go away from zero); the remainder ``b - (top << 16)``,
    in ``[-2^15, 2^15)``, is ``b``'s low 16 bits read as ``int16``. ``join`` computes
    ``(hi << 16) + lo``. A NaN splits as BF16's quiet NaN with remainder 0.

    Args:
        x: float32 values, any shape and device.

    Returns:
        ``(hi, lo)``: ``hi`` bfloat16 (equal to ``x.to(torch.bfloat16)`` except at exact ties, which
        round away from zero), ``lo`` int16, both of ``x``'s shape.

    Raises:
        TypeError: ``x`` is not a float32 tensor.
    """
    _check_f32(x, "x")
    x = x.contiguous()
    lo = torch.empty(x.shape, dtype=torch.int16, device=x.device)
    top = split_flat_(x, x.view(torch.int32), lo)
    return top.to(torch.int16).view(torch.bfloat16), lo


def join(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Rebuild the FP32 values that ``split`` took apart, bit for bit.

    Args:
        hi: the bfloat16 half (the model's weight).
        lo: the int16 remainder, of ``hi``'s shape.

    Returns:
        A new float32 tensor: ``(hi's pattern << 16) + lo`` reinterpreted as FP32.

    Raises:
        TypeError: wrong dtypes.
        ValueError: shapes differ.
    """
    _check_pair(hi, lo)
    # BF16 -> FP32 is exact: hi's 16 bits followed by 16 zero bits, i.e. hi << 16, in one pass.
    return hi.to(torch.float32).view(torch.int32).add_(lo).view(torch.float32)


def join_edited(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """``join``, except where ``hi`` is ±0 or ±inf: there the value is ``hi`` itself.

    ``split`` never pairs a zero with a negative remainder nor an infinity with a positive one, but
    an edit of the BF16 half after the split can (a pruning mask, a clamp to inf), and joined as
    bits those pairs are NaN. What this changes for values ``split`` produced: magnitudes below
    2^-133 (their BF16 half is 0) come back as ±0, magnitudes beyond BF16's largest finite number
    (their BF16 half is inf) as ±inf.

    Raises:
        TypeError: wrong dtypes.
        ValueError: shapes differ.
    """
    _check_pair(hi, lo)
    hf = hi.to(torch.float32)
    joined = hf.view(torch.int32).add(lo).view(torch.float32)
    return torch.where((hf != 0) & (hf.abs() != float("inf")), joined, hf)


def join_into_(out: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """``join`` into an existing float32 buffer (the step's scratch master); returns ``out``.

    Raises:
        TypeError: wrong dtypes.
        ValueError: shapes differ.
    """
    _check_pair(hi, lo, ("out", out))
    out.copy_(join(hi, lo))
    return out


def split_into_(x: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """``split`` ``x`` into the existing ``hi`` (the BF16 weight, in place) and ``lo`` buffers.

    Raises:
        TypeError: wrong dtypes.
        ValueError: shapes differ.
    """
    _check_pair(hi, lo, ("x", x))
    h, l_ = split(x)
    hi.copy_(h)
    lo.copy_(l_)


#: Elements per pass of :class:`RemainderBank`'s join and split (whole tensors per pass, one larger tensor
#: alone), on a GPU: few passes (each is about a dozen kernels), temporaries (about 11 bytes per element,
#: eagerly) bounded to 176 MiB.
BANK_CHUNK = 1 << 24
#: The same on a CPU, where the eager temporaries of a pass should stay in cache: 4.7M parameters in 24
#: tensors, AdamW, 2 threads (``benchmarks/remainder_step_cost.py --no-fused``, one run each), the eager
#: r16 step took 1.14x bf16-master's in passes of 2**18 elements, 1.17x at 2**20, 1.36x at 2**22.
BANK_CHUNK_CPU = 1 << 18


def join_flat_(out: torch.Tensor, bits: torch.Tensor, lo: torch.Tensor) -> None:
    """``out`` (FP32 holding the BF16 halves, exact) becomes ``join_edited(out, lo)``, in place.

    Args:
        out: flat float32, the BF16 halves converted (their bits followed by 16 zero bits).
        bits: ``out`` viewed as ``int32`` (the same memory: passed in so that no view is made per call).
        lo: the ``int16`` remainders, of ``out``'s shape.
    """
    # x / x == 1 exactly for every finite nonzero x and is NaN for 0 and inf (and NaN): the weights
    # join_edited keeps as they are take no remainder. Two ops where the explicit tests take four.
    bits.add_(lo * (out / out == 1))


def split_flat_(x: torch.Tensor, bits: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """``split(x)``, in place where it can be: writes the remainders into ``lo`` and returns the BF16 halves' bits.

    The algorithm of :func:`split` (which calls it).

    Args:
        x: contiguous float32 values (flat in a :class:`RemainderBank`'s passes).
        bits: ``x`` viewed as ``int32`` (the same memory).
        lo: the ``int16`` remainders, written.

    Returns:
        ``int32`` holding each BF16 half's 16-bit pattern as a signed value (copying it into an
        ``int16`` view of the weights keeps exactly those bits). Bit for bit :func:`split`.
    """
    nan = torch.isnan(x)
    # floor((b + 2^15) / 2^16) is (b >> 16) + (low >= 2^15): the top half rounded half up on the
    # magnitude (the arithmetic shift keeps the sign bit), and b - (top << 16) is the signed remainder.
    top = (bits + _HALF).bitwise_right_shift_(16)
    # Only NaNs need care (a payload in the low bits would round into inf or across the sign); inf
    # splits as (inf, 0) and values that round past BF16's largest finite number as (inf, negative).
    top.masked_fill_(nan, _BF16_NAN)
    # The remainder b - (top << 16) is in int16's range and equal to b modulo 2^16, so it *is* b's
    # low 16 bits read as int16: int32 -> int16 keeps exactly those (one pass, no subtraction).
    lo.copy_(bits)
    lo.masked_fill_(nan, 0)
    return top


def join_flat_compilable_(out: torch.Tensor, lo: torch.Tensor) -> None:
    """:func:`join_flat_` for ``torch.compile``: the same values, written through ``out`` itself.

    AOTAutograd refuses a graph that mutates an input through a view of another dtype, so the
    ``int32`` sum is formed inside the graph (a bit cast there) and copied into ``out``.
    """
    out.copy_((out.view(torch.int32) + lo * (out / out == 1)).view(torch.float32))


def split_flat_compilable_(x: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """:func:`split_flat_` for ``torch.compile`` (the ``int32`` view made inside the graph, not passed in)."""
    return split_flat_(x, x.view(torch.int32), lo)


class RemainderBank:
    """Remainder-stored FP32 masters of one device, joined and split in a fixed number of passes.

    The masters keep their identity (optimizer state and gradients are keyed by them) and
    between steps hold their placeholders. For a step :meth:`join` reallocates one flat FP32
    buffer (its storage is freed again by :meth:`split`, so between steps it costs nothing),
    points each master at its cached view of it and writes the joined values; :meth:`split`
    writes the weights and remainders back and restores the placeholders. The remainders are
    moved into one flat ``int16`` buffer at construction (:attr:`remainders`: views of it, to
    hold instead of the originals).

    Algorithm, per pass over whole tensors (at most ``chunk`` elements, one larger tensor
    alone): join: one ``_foreach_copy_`` of the BF16 weights into the FP32 views (exact:
    the BF16 bits followed by zeros), then the remainders added as integers where the weight is
    not ±0 or ±inf (``join_edited``); split: ``split`` of the flat slice, the remainders copied,
    one ``_foreach_copy_`` of the BF16 halves into the weights. So the aten ops per step do not
    depend on the number of tensors, and no per-tensor view is made after construction (the
    ``.data`` swaps of the masters dispatch no op). No host syncs.

    Args:
        params: the BF16 model parameters, contiguous, on one device (DTensor shards are not banked).
        masters: their masters (placeholders), parallel.
        remainders: their ``int16`` remainders, parallel.
        chunk: elements per pass (default :data:`BANK_CHUNK_CPU` on a CPU, else :data:`BANK_CHUNK`).

    Raises:
        ValueError: a weight is not contiguous, the lists differ in length, or the devices differ.
    """

    def __init__(self, params: list[torch.Tensor], masters: list[torch.Tensor], remainders: list[torch.Tensor],
                 chunk: int | None = None) -> None:
        weights = [p.detach() for p in params]
        if not (len(weights) == len(masters) == len(remainders)) or not weights:
            raise ValueError(f"a bank needs parallel, non-empty lists; got {len(weights)} weights, {len(masters)} "
                             f"masters and {len(remainders)} remainders")
        device = weights[0].device
        if any(not w.is_contiguous() or w.device != device for w in weights):
            raise ValueError("a bank's weights must be contiguous and on one device")
        self.params = params
        self.masters = masters
        self.sizes = [w.numel() for w in weights]
        total = sum(self.sizes)
        self.ptrs = [p.data_ptr() for p in params]
        self.rem = torch.cat([r.detach().reshape(-1) for r in remainders]) if total else torch.zeros(0, dtype=torch.int16,
                                                                                                     device=device)
        self.remainders = [v.view(w.shape) for v, w in zip(self.rem.split(self.sizes), weights)]
        self.flat = torch.empty(total, dtype=torch.float32, device=device)
        self.views = [v.view(w.shape) for v, w in zip(self.flat.split(self.sizes), weights)]
        self.placeholders = [m.data for m in masters]
        words = [w.view(torch.int16) for w in weights]  # the weights' bit patterns: the split writes them
        self._nbytes = self.flat.untyped_storage().nbytes()
        # Passes over whole tensors, at most ``chunk`` elements each (one larger tensor alone): the slices of
        # the flat buffer and of the remainders (views: they follow the buffer's storage as it is reallocated),
        # the 1-D views of the weights and of the masters' FP32 views, and the sizes.
        if chunk is None:
            chunk = BANK_CHUNK_CPU if device.type == "cpu" else BANK_CHUNK
        self.passes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor],
                                list[torch.Tensor], list[int]]] = []
        i, start = 0, 0
        while i < len(weights):
            j, n = i, 0
            while j < len(weights) and (j == i or n + self.sizes[j] <= chunk):
                n += self.sizes[j]
                j += 1
            flat = self.flat[start:start + n]
            self.passes.append((flat, flat.view(torch.int32), self.rem[start:start + n],
                                [w.view(-1) for w in weights[i:j]], [w.view(-1) for w in words[i:j]],
                                [v.view(-1) for v in self.views[i:j]], self.sizes[i:j]))
            i, start = j, start + n
        self.flat.untyped_storage().resize_(0)  # after the views: they are made on the allocated buffer
        self.live = False

    def valid(self) -> bool:
        """Whether the cached views still are the weights' (no ``p.data = ...`` replaced one)."""
        return list(map(torch.Tensor.data_ptr, self.params)) == self.ptrs

    def join(self, compiled: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
        """Give every master its exact FP32 value (allocates the flat buffer); nothing if already joined.

        Args:
            compiled: a compiled :func:`join_flat_compilable_` to use instead of :func:`join_flat_`.
        """
        if self.live:
            return
        self.flat.untyped_storage().resize_(self._nbytes)
        for flat, bits, rem, ws, _, fs, _ in self.passes:
            torch._foreach_copy_(fs, ws)
            if compiled is None:
                join_flat_(flat, bits, rem)
            else:
                compiled(flat, rem)
        for m, v in zip(self.masters, self.views):
            m.data = v
        self.live = True

    def split(self, compiled: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
        """Write every master's value into its weight and remainder, then free the flat buffer; nothing if not joined.

        Args:
            compiled: a compiled :func:`split_flat_compilable_` to use instead of :func:`split_flat_`.
        """
        if not self.live:
            return
        for flat, bits, rem, _, words, _, sizes in self.passes:
            top = split_flat_(flat, bits, rem) if compiled is None else compiled(flat, rem)
            torch._foreach_copy_(words, torch.split_with_sizes(top, sizes))
        for m, ph in zip(self.masters, self.placeholders):
            m.data = ph
        self.flat.untyped_storage().resize_(0)
        self.live = False
