// Shared pieces of the DWDP gather kernels (dwdp.kernels; docs/design.md §6.6).
//
// A gather copies a whole layer in one launch. Its input is a device table of
// descriptors, one per contiguous copy; the host (dwdp.kernels.table) packs it:
//
//   struct GatherDesc { u64 src; u64 dst; u64 nbytes; u64 chunk_begin; }   // 32 bytes
//
// src is an absolute device pointer (a peer view or this rank's store), dst an offset
// from the launch's dst_base (dst_base 0 makes it absolute), nbytes the size in bytes
// (any value), chunk_begin the prefix sum of ceil(nbytes / DWDP_CHUNK) over the earlier
// descriptors. Work is split into chunks of DWDP_CHUNK bytes numbered across the whole
// table; block b copies the chunks b, b + gridDim.x, b + 2 gridDim.x, ... so a grid of
// any size covers every byte exactly once and the blocks get equal work (within one
// chunk) however the bytes are spread over the descriptors.
//
// Alignment: a chunk whose source and destination are 16-byte aligned is copied in
// 16-byte units, and its last (nbytes mod 16) bytes one byte per thread; a descriptor
// whose source or destination is not 16-byte aligned is copied one byte per thread
// (correct, slow; the DWDP layouts align every blob).
#pragma once

typedef unsigned long long u64;
typedef unsigned int u32;

struct GatherDesc {
    u64 src;
    u64 dst;
    u64 nbytes;
    u64 chunk_begin;
};

// One chunk of the table: where it reads and writes, how many bytes, and how many of
// them go in 16-byte units (0 when the descriptor is not 16-byte aligned).
struct Chunk {
    const unsigned char* src;
    unsigned char* dst;
    u64 len;
    u64 vec_len;
};

// Advance the descriptor cursor d to the descriptor that holds global chunk c. Chunks
// visited by one block increase, so the cursor only moves forward (zero-byte
// descriptors own no chunk and are skipped).
__device__ __forceinline__ int dwdp_find_desc(const GatherDesc* __restrict__ table,
                                              int n_desc, int d, u64 c) {
    while (d + 1 < n_desc && __ldg(&table[d + 1].chunk_begin) <= c) {
        ++d;
    }
    return d;
}

__device__ __forceinline__ Chunk dwdp_chunk(const GatherDesc* __restrict__ table, int d,
                                            u64 c, unsigned char* dst_base) {
    const u64 src = __ldg(&table[d].src);
    const u64 dst = reinterpret_cast<u64>(dst_base) + __ldg(&table[d].dst);
    const u64 nbytes = __ldg(&table[d].nbytes);
    const u64 off = (c - __ldg(&table[d].chunk_begin)) * (u64)DWDP_CHUNK;
    u64 len = nbytes - off;
    if (len > (u64)DWDP_CHUNK) {
        len = (u64)DWDP_CHUNK;
    }
    Chunk k;
    k.src = reinterpret_cast<const unsigned char*>(src + off);
    k.dst = reinterpret_cast<unsigned char*>(dst + off);
    k.len = len;
    k.vec_len = (((src | dst) & 15ull) == 0) ? (len & ~15ull) : 0ull;
    return k;
}

// The bytes of a chunk past its 16-byte part, one byte per thread of the block.
__device__ __forceinline__ void dwdp_copy_scalar_tail(const Chunk& k) {
    for (u64 i = k.vec_len + threadIdx.x; i < k.len; i += blockDim.x) {
        k.dst[i] = k.src[i];
    }
}
