// The arguments of csrc/moe_rows.cu's gather and combine kernels: one struct per kernel, passed
// by value. The host layer (csrc/host/rows.cpp) fills them and the kernels read them, both from
// this one definition (NVRTC compiles it for the device, g++ for the host; plain pointers and
// integers lay out alike in both).
#pragma once

// Element kinds of the row kernels' tensors: 0 bf16, 1 fp16, 2 fp32 (-1: no tensor).
enum RowElementKind { kRowBF16 = 0, kRowF16 = 1, kRowF32 = 2, kRowNone = -1 };

// out[r] = x[t] (times scale[s]) with s = source[r], t = s / top_k; zero where s is not a pair
// in [0, num_pairs) (padding: -1). With `other`, also dot[s] = <x[t], other[r]> (fp32 sums in a
// fixed order), written only for the pairs that own a row. One warp a token (its pairs' rows,
// found through row_of), then one per 32 rows (the rows no token reached).
struct GatherRowsArgs {
  const void* x;       // (tokens, H) of `kind`, row stride x_stride elements, unit column stride
  const int* source;   // (rows,)
  const int* row_of;   // (tokens, top_k) contiguous
  const void* scale;   // (T, top_k) contiguous of scale_kind, or nullptr
  const void* other;   // (rows, H) of `kind`, row stride other_stride, or nullptr
  void* out;           // (rows, H) of `kind`, contiguous
  void* dot;           // (T, top_k) contiguous of dot_kind, with `other`
  long long x_stride, other_stride, rows, tokens, num_pairs;
  int H, top_k, kind, scale_kind, dot_kind;
  int vector;          // 1: rows move as 16-byte pieces (H and strides in 16 bytes, aligned)
};

// out[t] = sum over slots s, in order, of weights[t, s] * y[row_of[t, s]] in fp32; slots whose
// row_of names no row of y (dropped pairs: -1) add nothing. One thread a 16-byte piece of a row
// (one element without `vector`).
struct CombineRowsArgs {
  const void* y;        // (y_rows, H) of `kind`, row stride y_stride elements
  const int* row_of;    // (tokens, top_k) contiguous
  const void* weights;  // (tokens, top_k) contiguous of weight_kind, or nullptr (weights 1)
  void* out;            // (tokens, H) of `kind`, contiguous
  long long y_rows, y_stride, tokens;
  int H, top_k, kind, weight_kind;
  int vector;
};

// grouped_sum_rows' block: SUM_COLUMNS columns of a group by SUM_LANES row lanes.
constexpr int SUM_COLUMNS = 64, SUM_LANES = 4;

// Both compilers lay the structs out alike (one definition, plain fields in order of size; NVRTC
// has no offsetof): a size that differs fails the build of whichever disagrees. NVRTC compiles
// this in the CPU tier, and g++ builds the host layer there too.
static_assert(sizeof(GatherRowsArgs) == 120, "GatherRowsArgs: 7 pointers, 5 long longs, 6 ints");
static_assert(sizeof(CombineRowsArgs) == 80, "CombineRowsArgs: 4 pointers, 3 long longs, 5 ints and padding");
