// Metal address spaces, scoped to the kernel text (metal_emu_end.h removes them): `thread` would
// otherwise break std::thread, and `threadgroup` storage must be shared by the fibers of one group.
#define device
#define constant
#define thread
#define threadgroup static
