# cython: language_level=3
"""The C declarations `duvm.rdma._verbs` uses: libc, libibverbs, librdmacm and the small glue
header (`_verbs_glue.h`) for what Cython cannot declare (inline verbs, anonymous unions)."""

from libc.stdint cimport uint8_t, uint32_t, uint64_t

cdef extern from "<errno.h>":
    int errno

cdef extern from "<fcntl.h>":
    int fcntl(int fd, int cmd, ...)
    int F_GETFL
    int F_SETFL
    int O_NONBLOCK

cdef extern from "<string.h>":
    char *strerror(int errnum)

cdef extern from "<sys/mman.h>":
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)
    int mlock(const void *addr, size_t length)
    int PROT_READ
    int PROT_WRITE
    int MAP_PRIVATE
    int MAP_SHARED
    int MAP_ANONYMOUS
    int MAP_POPULATE
    void *MAP_FAILED

cdef extern from "<infiniband/verbs.h>":
    struct ibv_device:
        pass
    struct ibv_context:
        ibv_device *device
    struct ibv_pd:
        pass
    struct ibv_mr:
        uint32_t lkey
        uint32_t rkey
    struct ibv_comp_channel:
        int fd
    struct ibv_cq:
        pass
    struct ibv_srq:
        pass
    struct ibv_qp:
        uint32_t qp_num
    struct ibv_qp_cap:
        uint32_t max_send_wr
        uint32_t max_recv_wr
        uint32_t max_send_sge
        uint32_t max_recv_sge
        uint32_t max_inline_data
    enum ibv_qp_type:
        IBV_QPT_RC
    struct ibv_qp_init_attr:
        void *qp_context
        ibv_cq *send_cq
        ibv_cq *recv_cq
        ibv_srq *srq
        ibv_qp_cap cap
        ibv_qp_type qp_type
        int sq_sig_all
    struct ibv_device_attr:
        int max_qp_rd_atom
        int max_qp_init_rd_atom
        int max_qp_wr
    enum ibv_port_state:
        IBV_PORT_ACTIVE
    struct ibv_port_attr:
        ibv_port_state state
    int IBV_ACCESS_LOCAL_WRITE
    int IBV_ACCESS_REMOTE_WRITE
    int IBV_ACCESS_REMOTE_READ
    int IBV_WC_SUCCESS
    ibv_device **ibv_get_device_list(int *num_devices)
    void ibv_free_device_list(ibv_device **lst)
    const char *ibv_get_device_name(ibv_device *device)
    ibv_context *ibv_open_device(ibv_device *device)
    int ibv_close_device(ibv_context *context)
    int ibv_query_device(ibv_context *context, ibv_device_attr *attr)
    int ibv_query_port(ibv_context *context, uint8_t port, ibv_port_attr *attr)
    ibv_pd *ibv_alloc_pd(ibv_context *context)
    int ibv_dealloc_pd(ibv_pd *pd)
    ibv_mr *ibv_reg_mr(ibv_pd *pd, void *addr, size_t length, int access)
    int ibv_dereg_mr(ibv_mr *mr)
    ibv_comp_channel *ibv_create_comp_channel(ibv_context *context)
    int ibv_destroy_comp_channel(ibv_comp_channel *channel)
    ibv_cq *ibv_create_cq(ibv_context *context, int cqe, void *cq_context,
                          ibv_comp_channel *channel, int comp_vector)
    int ibv_destroy_cq(ibv_cq *cq)
    int ibv_get_cq_event(ibv_comp_channel *channel, ibv_cq **cq, void **cq_context)
    void ibv_ack_cq_events(ibv_cq *cq, unsigned int nevents)
    const char *ibv_wc_status_str(int status)

cdef extern from "<rdma/rdma_cma.h>":
    struct rdma_event_channel:
        int fd
    struct rdma_cm_id:
        ibv_context *verbs
        void *context
        ibv_qp *qp
        uint8_t port_num
    struct rdma_conn_param:
        const void *private_data
        uint8_t private_data_len
        uint8_t responder_resources
        uint8_t initiator_depth
    struct rdma_cm_event:
        rdma_cm_id *id
        rdma_cm_id *listen_id
        int event
        int status
    struct sockaddr:
        pass
    struct rdma_addrinfo:
        int ai_flags
        sockaddr *ai_src_addr
        sockaddr *ai_dst_addr
    int RAI_PASSIVE
    int RDMA_PS_TCP
    rdma_event_channel *rdma_create_event_channel()
    void rdma_destroy_event_channel(rdma_event_channel *channel)
    int rdma_create_id(rdma_event_channel *channel, rdma_cm_id **id, void *context, int ps)
    int rdma_destroy_id(rdma_cm_id *id)
    int rdma_bind_addr(rdma_cm_id *id, sockaddr *addr)
    int rdma_listen(rdma_cm_id *id, int backlog)
    int rdma_resolve_addr(rdma_cm_id *id, sockaddr *src, sockaddr *dst, int timeout_ms)
    int rdma_resolve_route(rdma_cm_id *id, int timeout_ms)
    int rdma_create_qp(rdma_cm_id *id, ibv_pd *pd, ibv_qp_init_attr *attr)
    void rdma_destroy_qp(rdma_cm_id *id)
    int rdma_connect(rdma_cm_id *id, rdma_conn_param *param)
    int rdma_accept(rdma_cm_id *id, rdma_conn_param *param)
    int rdma_reject(rdma_cm_id *id, const void *data, uint8_t len)
    int rdma_disconnect(rdma_cm_id *id)
    int rdma_get_cm_event(rdma_event_channel *channel, rdma_cm_event **event)
    int rdma_ack_cm_event(rdma_cm_event *event)
    const char *rdma_event_str(int event)
    int rdma_getaddrinfo(const char *node, const char *service, const rdma_addrinfo *hints,
                         rdma_addrinfo **res)
    void rdma_freeaddrinfo(rdma_addrinfo *res)
    int RDMA_CM_EVENT_ADDR_RESOLVED
    int RDMA_CM_EVENT_ROUTE_RESOLVED
    int RDMA_CM_EVENT_CONNECT_REQUEST
    int RDMA_CM_EVENT_ESTABLISHED
    int RDMA_CM_EVENT_DISCONNECTED
    int RDMA_CM_EVENT_REJECTED
    int RDMA_CM_EVENT_UNREACHABLE
    int RDMA_CM_EVENT_ADDR_ERROR
    int RDMA_CM_EVENT_ROUTE_ERROR
    int RDMA_CM_EVENT_CONNECT_ERROR
    int RDMA_CM_EVENT_DEVICE_REMOVAL
    int RDMA_CM_EVENT_TIMEWAIT_EXIT

cdef extern from "_verbs_glue.h":
    int duvm_post_chain(ibv_qp *qp, uint64_t wr_id, int write, int n, const uint64_t *laddr,
                        const uint32_t *length, uint32_t lkey, const uint64_t *raddr,
                        uint32_t rkey) nogil
    int duvm_poll(ibv_cq *cq, int max, uint64_t *wr_id, int *status, int *opcode) nogil
    int duvm_req_notify(ibv_cq *cq) nogil
    void duvm_conn_param(rdma_conn_param *p, const void *data, uint8_t length, uint8_t depth)
    const void *duvm_event_private_data(rdma_cm_event *event)
    uint8_t duvm_event_private_len(rdma_cm_event *event)
