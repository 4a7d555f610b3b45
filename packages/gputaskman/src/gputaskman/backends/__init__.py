"""GPU backends: NVML, DRM (amdgpu, i915, xe), Ascend, Windows (WDDM through DXGI and PDH, TCC
through NVML), WSL and macOS (IOKit); `linux` merges NVML, DRM and Ascend into the Linux
source, and `registry` chooses and builds the backend a machine gets. Each imports its
platform's libraries only when used.

Every backend implements one contract, `base.gpusource.GpuSource`: a class with
``sample() -> GpuSample`` (adapters, their `DeviceMetrics`, `GpuProcess` rows, problems,
notes; unknown is a missing `Reading` with a reason, never 0; never raises for a driver
error) and an idempotent ``close()``; ``backend_for`` only when the snapshot's backend
name depends on the selected GPU. To add one: read that module's docstring and one backend
(`macos` is small), write ``backends/<name>.py``, add its builder to `registry.REGISTRY`
(and to `registry.detect_backend` if a platform selects it), and add it to
``tests/test_backend_contract.py``, which runs every backend through the same checks.

May import: gputaskman.base.
"""
