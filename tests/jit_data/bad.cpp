// Test source with a compile error.
int cam_jit_bad() { return undeclared_in_cam_jit_test + 1; }
