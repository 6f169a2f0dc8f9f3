// Stub of the Metal Shading Language for a syntax check with clang (or g++), `-include`d before
// the generated source. Declarations only: nothing here runs. It is deliberately narrow: no C++
// standard library, no `using namespace metal`, so a name Metal lacks (std::, an unqualified
// builtin) fails here as it would on a Mac. With clang the address spaces are real clang address
// spaces, so e.g. binding a threadgroup array to a plain pointer is an error, as in Metal.
#if defined(__clang__)
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup static __attribute__((address_space(3)))
#else
#define device
#define constant
#define threadgroup static
#endif
#define thread

typedef __SIZE_TYPE__ size_t;
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef _Float16 half;
typedef _Float16 float16_t;
struct bfloat16_t {
  unsigned short bits;
  bfloat16_t() = default;
  bfloat16_t(float);
  operator float() const;
};
struct uint2 { uint x, y; };
struct uint3 { uint x, y, z; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };

#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")

template <class T, class U> T as_type(U);

namespace metal {
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
void threadgroup_barrier(mem_flags);
void simdgroup_barrier(mem_flags);
template <class T> T simd_sum(T);
template <class T> T simd_max(T);
template <class T> T simd_min(T);
template <class T> T simd_shuffle(T, ushort);
template <class T> T simd_shuffle_xor(T, ushort);
template <class T> T simd_shuffle_down(T, ushort);
template <class T> T simd_shuffle_up(T, ushort);
template <class T> T simd_broadcast(T, ushort);
template <class T> T quad_sum(T);
template <class T> T min(T, T);
template <class T> T max(T, T);
template <class T> T clamp(T, T, T);
template <class T> T select(T, T, bool);
template <class T> T abs(T);
uint popcount(uint);
float rint(float);
float round(float);
float floor(float);
float ceil(float);
float exp(float);
float exp2(float);
float log(float);
float sqrt(float);
float rsqrt(float);
float fabs(float);
float fma(float, float, float);
bool isnan(float);
bool isinf(float);
half exp(half);
half rint(half);
namespace fast {
float exp(float);
float exp2(float);
float log(float);
float sqrt(float);
float rsqrt(float);
}  // namespace fast
namespace precise {
float divide(float, float);
float exp(float);
}  // namespace precise
}  // namespace metal
