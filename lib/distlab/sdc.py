"""Chapter 11 §2c: silent data corruption, one flipped bit on one rank, and a detector for it.

A faulty GPU can return a wrong number without raising anything. In data parallelism its
replica then differs from the others, which must hold the same weights bit for bit. Chapter 11's
`debug.checksums` compare float64 SUMS, and a sum rounds: a flip of a float64 weight's lowest
bits can vanish in it. `bit_checksums` sums the raw bits in 16-bit pieces instead, in integers,
so any changed bit changes it, on the device, a few integers per tensor.
"""
import torch

_BITS = {torch.float64: torch.int64, torch.float32: torch.int32,
         torch.bfloat16: torch.int16, torch.float16: torch.int16}
_LIMB = 16
_PERIOD = 65521        # a prime below 2**16: position weights stay small, sums stay exact


def _raw_bits(t):
    if t.dtype not in _BITS:
        raise TypeError(f"only floating tensors have a bit pattern here "
                        f"({', '.join(str(d) for d in _BITS)}), not {t.dtype}.")
    return t.detach().contiguous().view(_BITS[t.dtype]).reshape(-1)


def flip_bit(t, index, bit):
    """Flip bit `bit` (0 = the lowest mantissa bit) of element `index` of t (flat), in place,
    as a faulty chip would. Returns (before, after) as Python floats."""
    width = torch.finfo(t.dtype).bits if t.dtype in _BITS else 0
    if not 0 <= bit < width:
        raise ValueError(f"a {t.dtype} has bits 0..{width - 1}; bit {bit} does not exist.")
    if not 0 <= index < t.numel():
        raise IndexError(f"element {index} of a tensor of {t.numel()} elements does not exist.")
    raw = _raw_bits(t)
    if raw.data_ptr() != t.data_ptr():
        raise ValueError("flip_bit changes the tensor in place: give it a contiguous tensor.")
    before = t.reshape(-1)[index].item()
    mask = 1 << bit
    if mask >= 2 ** (width - 1):        # the sign bit: its mask is negative in a signed view
        mask -= 2 ** width
    with torch.no_grad():
        raw[index] ^= mask
    return before, t.reshape(-1)[index].item()


def bit_checksums(tensors):
    """Two integers per 16-bit piece of each tensor's raw bits: their sum and a position-weighted
    sum. One row of 8 int64 numbers per tensor (zeros where a dtype has fewer pieces).

    Integer sums of 16-bit pieces are exact, so a single changed bit always changes a plain sum;
    the weighted sum also catches two elements swapped (unless their positions differ by a
    multiple of 65521). Equal tensors give equal rows on any machine.
    """
    rows = []
    for t in tensors:
        bits = _raw_bits(t).to(torch.int64)
        pos = torch.arange(bits.numel(), device=bits.device) % _PERIOD + 1
        row = []
        for shift in range(0, 64, _LIMB):
            if shift < 8 * t.element_size():
                limb = (bits >> shift) & (2 ** _LIMB - 1)
                row += [limb.sum(), (limb * pos).sum()]
            else:
                row += [torch.zeros((), dtype=torch.int64, device=bits.device)] * 2
        rows.append(torch.stack(row))
    return torch.stack(rows)


def odd_replicas(rows_by_rank, names):
    """Given every rank's checksum rows (one tensor per rank, one row per named tensor): for each
    tensor whose rows are not all equal, (name, ranks) with the ranks whose row differs from the
    majority's, or (name, None) where no row is held by more than half of the ranks (with two
    replicas there is no majority: a mismatch does not say which rank is wrong)."""
    if len(rows_by_rank) < 1 or any(len(r) != len(names) for r in rows_by_rank):
        raise ValueError(f"give one tensor per rank with one row per name ({len(names)} names).")
    found = []
    for i, name in enumerate(names):
        rows = [r[i] for r in rows_by_rank]
        if all(torch.equal(rows[0], r) for r in rows[1:]):
            continue
        agree = [sum(torch.equal(a, b) for b in rows) for a in rows]
        best = max(range(len(rows)), key=lambda r: agree[r])
        if 2 * agree[best] <= len(rows):
            found.append((name, None))
        else:
            found.append((name, [r for r, row in enumerate(rows)
                                 if not torch.equal(row, rows[best])]))
    return found
