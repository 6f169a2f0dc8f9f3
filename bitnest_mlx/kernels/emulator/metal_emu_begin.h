// Metal address spaces, scoped to the kernel text (metal_emu_end.h removes them): `thread` would
// otherwise break std::thread, and `threadgroup` storage must be shared by the fibers of one group.
// Counting builds (clang) keep them as real address spaces, so the IR tells device, constant and
// threadgroup accesses apart.
#if defined(EMU_COUNT)
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup static __attribute__((address_space(3)))
#else
#define device
#define constant
#define threadgroup static
#endif
#define thread
