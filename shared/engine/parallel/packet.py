"""A step's inputs as one int64 tensor, which rank 0 sends to the other ranks (pure).

Layout: [tokens T, prefill segments P, decode rows B, block table width W], then per segment
(start, length, cached, table length), then the decode group's start (when B > 0), then
the token ids, positions and slots (T each), each segment's block table, the decode group's
block tables (B x W) and context lengths (B). The decode mask is rebuilt from the lengths."""

from __future__ import annotations

import torch

from shared.engine.attention import AttentionMetadata, DecodeGroup, PrefillSegment


def pack(ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    group = meta.decode
    batch, width = (0, 0) if group is None else group.block_tables.shape
    header = [ids.numel(), len(meta.prefills), batch, width]
    for seg in meta.prefills:
        header += [seg.start, seg.length, seg.cached, seg.block_table.numel()]
    parts = [ids, positions, meta.slots, *(seg.block_table for seg in meta.prefills)]
    if group is not None:
        header.append(group.start)
        parts += [group.block_tables.reshape(-1), group.context_lens]
    return torch.cat([torch.tensor(header, dtype=torch.long),
                      *(p.to("cpu", torch.long) for p in parts)])


def unpack(packet: torch.Tensor, block_size: int, device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(token ids, positions, attention metadata) on `device`, as rank 0 computed them."""
    tokens, num_prefills, batch, width = packet[:4].tolist()
    at = 4 + 4 * num_prefills + (1 if batch else 0)
    header = packet[4:at].tolist()  # (start, length, cached, table length) a segment, ...
    shapes = [header[i:i + 4] for i in range(0, 4 * num_prefills, 4)]
    start = header[-1] if batch else 0
    data = packet[at:].to(device)

    def take(n: int) -> torch.Tensor:
        nonlocal data
        head, data = data[:n], data[n:]
        return head

    ids, positions, slots = take(tokens), take(tokens), take(tokens)
    prefills = [PrefillSegment(s, length, cached, take(n)) for s, length, cached, n in shapes]
    decode = None
    if batch:
        tables = take(batch * width).view(batch, width)
        decode = DecodeGroup.of(start, tables, take(batch), block_size)
    return ids, positions, AttentionMetadata(slots, prefills, decode)
