// The index stage (index_stage.cu) includes this for the CuTe / CUTLASS headers the attention kernel's configuration
// pulls in; the configuration itself lives in cuda/attention/config.h.
#pragma once

#include "cuda/attention/config.h"
