#pragma once
// Whether this test program is built with a sanitizer: tests whose every repetition exercises the
// same code run fewer repetitions under one (each costs 2-3x under AddressSanitizer, 5-15x under
// ThreadSanitizer), so the sanitizer jobs fit in CI's time. The plain build keeps every repetition.

namespace tutti::test_support {

#if defined(__SANITIZE_THREAD__)
#define TUTTI_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TUTTI_TEST_TSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define TUTTI_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TUTTI_TEST_ASAN 1
#endif
#endif

#ifdef TUTTI_TEST_TSAN
inline constexpr bool kThreadSanitizer = true;
#else
inline constexpr bool kThreadSanitizer = false;
#endif
#ifdef TUTTI_TEST_ASAN
inline constexpr bool kAddressSanitizer = true;
#else
inline constexpr bool kAddressSanitizer = false;
#endif
inline constexpr bool kSanitizer = kThreadSanitizer || kAddressSanitizer;

}  // namespace tutti::test_support
