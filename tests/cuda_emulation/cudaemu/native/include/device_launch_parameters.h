// Everything CUDA declares here comes from emu.h, which every kernel source includes.
#pragma once
