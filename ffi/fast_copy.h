// Copies for large transfers. glibc's memcpy switches to non-temporal
// (cache-bypassing) stores only above a threshold (192 MiB here), so the
// copy engine's 4 MiB chunks would take the slower cached path that a
// single large memcpy avoids; streaming stores make a chunked copy as fast
// as one big one.
#ifndef JCXL_FFI_FAST_COPY_H_
#define JCXL_FFI_FAST_COPY_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

// The sanitizers do not check streaming stores: their builds copy with
// memcpy, whose every byte they check.
#if (defined(__x86_64__) || defined(__SSE2__)) && \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#include <emmintrin.h>
#define JCXL_HAVE_STREAMING_STORES 1
#endif

namespace jcxl {

// Below this a plain memcpy is as fast (the data fits in cache anyway).
constexpr size_t kStreamingCopyMinBytes = 1 << 20;

inline void CopyLarge(void* dst, const void* src, size_t n) {
#ifdef JCXL_HAVE_STREAMING_STORES
  if (n < kStreamingCopyMinBytes) {
    std::memcpy(dst, src, n);
    return;
  }
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  // Align the destination to 64 bytes, stream whole cache lines, then copy
  // the tail; the fence makes the streamed bytes visible before we return.
  const size_t head = (64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63;
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  const size_t lines = n / 64;
  for (size_t i = 0; i < lines; ++i) {
    const __m128i* from = reinterpret_cast<const __m128i*>(s + 64 * i);
    __m128i* to = reinterpret_cast<__m128i*>(d + 64 * i);
    __m128i a = _mm_loadu_si128(from);
    __m128i b = _mm_loadu_si128(from + 1);
    __m128i c = _mm_loadu_si128(from + 2);
    __m128i e = _mm_loadu_si128(from + 3);
    _mm_stream_si128(to, a);
    _mm_stream_si128(to + 1, b);
    _mm_stream_si128(to + 2, c);
    _mm_stream_si128(to + 3, e);
  }
  std::memcpy(d + 64 * lines, s + 64 * lines, n - 64 * lines);
  _mm_sfence();
#else
  std::memcpy(dst, src, n);
#endif
}

}  // namespace jcxl

#endif  // JCXL_FFI_FAST_COPY_H_
