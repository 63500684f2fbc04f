//! \file
//! Expert placement: the placement map and replica choice, statistics and profiling, the
//! policies (contiguous, round-robin, load-balanced, collaboration-aware, replicated with
//! optional expert groups, one layer or many),
//! migration planning, quality metrics, and routing traces (synthetic and from files).
//! Host-only; no backend headers.
#pragma once

#include "weave/placement/after_loss.hpp"
#include "weave/placement/collaboration.hpp"
#include "weave/placement/hungarian.hpp"
#include "weave/placement/metrics.hpp"
#include "weave/placement/migration.hpp"
#include "weave/placement/placement.hpp"
#include "weave/placement/policies.hpp"
#include "weave/placement/profiling.hpp"
#include "weave/placement/replica_choice.hpp"
#include "weave/placement/replica_packing.hpp"
#include "weave/placement/replication.hpp"
#include "weave/placement/replication_groups.hpp"
#include "weave/placement/replication_layers.hpp"
#include "weave/placement/statistics.hpp"
#include "weave/placement/survivable.hpp"
#include "weave/placement/topology.hpp"
#include "weave/placement/trace.hpp"
#include "weave/placement/trace_io.hpp"
