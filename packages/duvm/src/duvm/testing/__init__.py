"""Support for duvm's own tests and benchmarks, never used by the product's paths.

`netns_cluster` builds a real multi-node cluster on one machine (network namespaces, veth,
a bridge); `nbd_workload` is a verifying block workload run through libnbd by the system
Python; `fake_verbs` is a verbs device that checks what a NIC checks, for the memserver's RDMA
service where no RDMA device is. Nothing outside this folder imports them except `tests/` and
`benchmarks/`.

May import: any layer.
"""
