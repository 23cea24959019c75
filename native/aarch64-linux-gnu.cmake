# CMake toolchain for a Linux aarch64 device (Jetson, a Raspberry Pi 4/5, an Arm server) built
# on an x86_64 machine with Debian's cross compiler (apt install g++-aarch64-linux-gnu), against
# the ExecuTorch wheel for that platform unpacked beside it (docs/phone-devices.md, "Other
# platforms"). Pass -DCMAKE_TOOLCHAIN_FILE=native/aarch64-linux-gnu.cmake and
# -DCMAKE_PREFIX_PATH=<unpacked>/executorch.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
# libraries and headers from the target's sysroot and the prefix path; header-only
# packages (nlohmann_json) from the host's CMake package folders
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
# pkg-config (libmosquitto, libsodium, OpenBLAS) sees the target's packages only (Debian multiarch: <name>:arm64),
# never the host's x86_64 ones
if(NOT DEFINED ENV{PKG_CONFIG_LIBDIR})
  set(ENV{PKG_CONFIG_LIBDIR} "/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig")
endif()
