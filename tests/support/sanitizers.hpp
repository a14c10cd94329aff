#pragma once
// Whether this test program is built with ThreadSanitizer: tests whose every repetition exercises
// the same code between threads run fewer repetitions under it (each costs 5-15x there), so the
// sanitizer jobs fit in CI's time. The plain build keeps every repetition.

namespace tutti::test_support {

#if defined(__SANITIZE_THREAD__)
#define TUTTI_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TUTTI_TEST_TSAN 1
#endif
#endif
#ifdef TUTTI_TEST_TSAN
inline constexpr bool kThreadSanitizer = true;
#else
inline constexpr bool kThreadSanitizer = false;
#endif

}  // namespace tutti::test_support
