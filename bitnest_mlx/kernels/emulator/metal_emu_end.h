#undef device
#undef constant
#undef thread
#undef threadgroup
