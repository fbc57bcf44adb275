// Tiny test library: no torch header, so it compiles in well under a second.
#include "tiny.h"
extern "C" int cam_jit_tiny() { return CAM_JIT_TINY_ANSWER; }
