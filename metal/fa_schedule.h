// Which block of which (batch, head) a threadgroup of the tiled kernels (forward, dK/dV, dQ) owns.
//
// Without a band (causal mask, window) every block costs the same and the grid is (blocks, heads,
// batch), so consecutive threadgroups share a head's K and V. Under a causal band a block's cost
// grows with its position (a query block sees the keys up to its diagonal; a key block the
// queries from it on), and a GPU starts threadgroups roughly in grid order: the planner then makes
// the blocks the slowest axis, (heads, batch, blocks), and blocks are numbered heaviest first
// across all heads, so the light ones fill the tail instead of a few heavy ones running alone at
// the end (longest job first). A window alone costs about the same per block; the order does no
// harm there.
#ifndef FA_SCHEDULE_H
#define FA_SCHEDULE_H

#include <metal_stdlib>
#include "fa_params.h"

struct fa_block_position {
  int block; // block index along the rows (query blocks) or keys (key blocks)
  long head;
  long batch;
};

// heaviest_last: the causal cost grows with the block index (query blocks) rather than shrinking
// (key blocks).
inline fa_block_position fa_block_of(uint3 group, uint3 groups, bool heaviest_last) {
  fa_block_position at;
  if (fa_banded) {
    at.block = heaviest_last ? int(groups.z - 1 - group.z) : int(group.z);
    at.head = group.x;
    at.batch = group.y;
  } else {
    at.block = int(group.x);
    at.head = group.y;
    at.batch = group.z;
  }
  return at;
}

#endif
