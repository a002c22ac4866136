"""The bounded set of padded shapes the step programs are compiled for.

Prefill programs are keyed by (tokens T, sequences N): both matter because
the model gathers and scatters one GDN state per sequence, so padding
sequences are not free. Decode programs have T == N. Token buckets are powers
of two (padding waste under 2x); prefill sequence buckets are powers of four,
because the grid multiplies and a prefill step pads rows, not work; decode
buckets are powers of two, as decode time is what every token pays.
"""

from dataclasses import dataclass


def _powers(lo: int, hi: int, base: int = 2) -> list[int]:
    out, x = [], lo
    while x < hi:
        out.append(x)
        x *= base
    return out + [hi]


@dataclass(frozen=True)
class Buckets:
    prefill_tokens: tuple[int, ...]
    prefill_seqs: tuple[int, ...]
    decode_seqs: tuple[int, ...]

    @staticmethod
    def default(max_num_seqs: int, max_num_batched_tokens: int, min_tokens: int = 32) -> "Buckets":
        return Buckets(tuple(_powers(min(min_tokens, max_num_batched_tokens), max_num_batched_tokens)),
                       tuple(_powers(1, max_num_seqs, 4)), tuple(_powers(1, max_num_seqs)))

    @staticmethod
    def few(max_num_seqs: int, max_num_batched_tokens: int) -> "Buckets":
        """Three programs: a 32-token and a full prefill, and one decode, all at
        `max_num_seqs` sequences (CPU defaults: each program costs seconds to compile)."""
        t = max_num_batched_tokens
        return Buckets(tuple(sorted({min(32, t), t})), (max_num_seqs,), (max_num_seqs,))

    def all_shapes(self) -> list[tuple[bool, int, int]]:
        """(is_decode, T, N) of every program compiled at start-up."""
        shapes = [(True, n, n) for n in self.decode_seqs]
        lowest = [1] + [n + 1 for n in self.prefill_seqs[:-1]]  # fewest seqs mapping to each N
        shapes += [(False, t, n) for t in self.prefill_tokens
                   for n, lo in zip(self.prefill_seqs, lowest) if lo <= t]
        return shapes

    def pick(self, is_decode: bool, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        if is_decode:
            n = _ceil_in(self.decode_seqs, num_seqs)
            return n, n
        return _ceil_in(self.prefill_tokens, num_tokens), _ceil_in(self.prefill_seqs, num_seqs)


def _ceil_in(sizes, x: int) -> int:
    for s in sizes:
        if s >= x:
            return s
    raise ValueError(f"{x} exceeds the largest bucket {sizes[-1]}")
