// What the kernel files take from torch, and no more: ATen's tensors and parallel_for, and pybind11
// with torch's tensor type casters. <torch/extension.h> also brings the whole C++ frontend
// (torch::nn, optimizers, autograd), which doubled the compile time of each extension (a bare
// module: 69 s against 32 s on a Zen 3), and `pip install -e .` compiles six of them.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>
