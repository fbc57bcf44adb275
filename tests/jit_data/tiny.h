// Header of the tiny test library (hashed into the cache key, not compiled on its own).
#pragma once
#define CAM_JIT_TINY_ANSWER 42
