//! \file
//! Core vocabulary: errors, checked arithmetic, element types, memory spaces, tensor views,
//! workspaces. Host-only; no backend headers.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/dtype.hpp"
#include "weave/core/error.hpp"
#include "weave/core/failure.hpp"
#include "weave/core/fp8.hpp"
#include "weave/core/host_matrix.hpp"
#include "weave/core/memory.hpp"
#include "weave/core/tensor.hpp"
#include "weave/core/tensor_args.hpp"
#include "weave/core/trace_writer.hpp"
#include "weave/core/workspace.hpp"
