"""Canonical, length-limited Huffman codes over a small alphabet, with whole-array encode and decode.

Decoding a prefix code is sequential by nature; here it is done without a per-symbol loop: the
codeword that would start at *every* bit position is looked up in one table pass, and the chain
of actual codeword starts is followed by pointer doubling (log2(count) gathers over the stream).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from sparsecomm.encode.bits import pack_varwidth
from sparsecomm.errors import PayloadError

MAX_CODE_LENGTH = 16


def code_lengths(freqs: np.ndarray, max_length: int = MAX_CODE_LENGTH) -> np.ndarray:
    """Huffman code lengths (0 for unused symbols), at most ``max_length`` bits."""
    freqs = np.asarray(freqs, dtype=np.int64)
    lengths = np.zeros(freqs.size, dtype=np.int64)
    used = np.flatnonzero(freqs)
    if used.size == 1:
        lengths[used] = 1
    if used.size <= 1:
        return lengths
    weights = freqs[used].copy()
    while True:  # loop over the alphabet, not the data: flatten the weights until the code fits
        heap = [(int(w), i, [i]) for i, w in enumerate(weights)]
        heapq.heapify(heap)
        depth = np.zeros(used.size, dtype=np.int64)
        tiebreak = used.size
        while len(heap) > 1:
            w1, _, s1 = heapq.heappop(heap)
            w2, _, s2 = heapq.heappop(heap)
            members = s1 + s2
            depth[members] += 1
            heapq.heappush(heap, (w1 + w2, tiebreak, members))
            tiebreak += 1
        if depth.max() <= max_length:
            lengths[used] = depth
            return lengths
        weights = (weights + 1) // 2


@dataclass(frozen=True)
class HuffmanCode:
    """A canonical prefix code given by per-symbol code lengths (0 = symbol unused)."""

    lengths: np.ndarray

    @classmethod
    def from_frequencies(cls, freqs: np.ndarray) -> HuffmanCode:
        return cls(code_lengths(freqs))

    @classmethod
    def from_lengths(cls, lengths: np.ndarray) -> HuffmanCode:
        """Validates lengths read from a payload (range and Kraft inequality)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.size and (lengths.min() < 0 or lengths.max() > MAX_CODE_LENGTH):
            raise PayloadError("Huffman code length out of range")
        kraft = int(np.sum(np.left_shift(1, MAX_CODE_LENGTH - lengths[lengths > 0])))
        if kraft > 1 << MAX_CODE_LENGTH:
            raise PayloadError("Huffman code lengths violate the Kraft inequality")
        return cls(lengths)

    def codes(self) -> np.ndarray:
        """Canonical codewords: by (length, symbol), each the previous plus one, shifted to length."""
        codes = np.zeros(self.lengths.size, dtype=np.uint64)
        order = np.lexsort((np.arange(self.lengths.size), self.lengths))
        order = order[self.lengths[order] > 0]
        code, previous = 0, 0
        for symbol in order:  # alphabet-sized loop
            length = int(self.lengths[symbol])
            code <<= length - previous
            codes[symbol] = code
            code, previous = code + 1, length
        return codes

    def encode(self, symbols: np.ndarray) -> tuple[bytes, int]:
        """Symbols → (bytes, bit count)."""
        lengths = self.lengths[symbols]
        if symbols.size and lengths.min() == 0:
            raise ValueError("symbol outside the code's alphabet")
        return pack_varwidth(self.codes()[symbols], lengths)

    def decode(self, data: bytes | memoryview, count: int) -> tuple[np.ndarray, int]:
        """(``count`` symbols, bits consumed) from the start of ``data``."""
        if count == 0:
            return np.zeros(0, dtype=np.int64), 0
        width = MAX_CODE_LENGTH
        stream = np.frombuffer(data, dtype=np.uint8)
        total_bits = 8 * stream.size
        if total_bits < count:
            raise PayloadError("Huffman stream too short")
        table_symbol, table_length = self._lookup_table(width)
        # the width-bit window starting at every bit position
        padded = np.concatenate([stream, np.zeros(4, dtype=np.uint8)]).astype(np.uint32)
        words = (padded[:-3] << 24) | (padded[1:-2] << 16) | (padded[2:-1] << 8) | padded[3:]
        positions = np.arange(total_bits, dtype=np.int64)
        windows = ((words[positions >> 3] << (positions & 7).astype(np.uint32)) >> (32 - width)) & (
            (1 << width) - 1
        )
        step = table_length[windows]
        jump = np.minimum(positions + np.maximum(step, 1), total_bits)
        jump = np.append(jump, total_bits)  # sentinel: past the end stays past the end
        starts = np.zeros(1, dtype=np.int64)
        while starts.size < count:
            starts = np.concatenate([starts, jump[starts]])
            jump = jump[jump]
        starts = starts[:count]
        if starts[-1] >= total_bits or (step[starts] == 0).any():
            raise PayloadError("Huffman stream is corrupt or too short")
        end = int(starts[-1] + step[starts[-1]])
        if end > total_bits:
            raise PayloadError("Huffman stream ends inside a codeword")
        return table_symbol[windows[starts]], end

    def _lookup_table(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        size = 1 << width
        symbol_table = np.zeros(size, dtype=np.int64)
        length_table = np.zeros(size, dtype=np.int64)
        codes = self.codes()
        for symbol in np.flatnonzero(self.lengths):
            length = int(self.lengths[symbol])
            lo = int(codes[symbol]) << (width - length)
            hi = lo + (1 << (width - length))
            symbol_table[lo:hi] = symbol
            length_table[lo:hi] = length
        return symbol_table, length_table
