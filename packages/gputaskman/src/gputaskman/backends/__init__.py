"""GPU backends: NVML, DRM (amdgpu, i915, xe), Ascend, Windows (WDDM through DXGI and PDH, TCC
through NVML), WSL and macOS (IOKit), and `platforms` (which one a machine gets, the sample
types the non-Linux ones share). Each imports its platform's libraries only when used.

May import: gputaskman.base.
"""
