/* The verbs calls duvm's RDMA path makes, as plain C functions for Cython: ibv_post_send and
 * ibv_poll_cq are static inline in <infiniband/verbs.h>, and a work request's remote address sits
 * in an anonymous union that Cython cannot name. Nothing here allocates or keeps state. */
#ifndef DUVM_VERBS_GLUE_H
#define DUVM_VERBS_GLUE_H

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

/* Post `n` one-sided requests (RDMA WRITE when `write`, else RDMA READ) as one chain: one
 * doorbell for the lot. Only the last is signalled: an RC queue pair completes in order, so its
 * completion means every earlier one finished, and an error on any of them fails the queue pair
 * and flushes the rest with errors. Returns 0 or an errno. */
static inline int duvm_post_chain(struct ibv_qp *qp, uint64_t wr_id, int write, int n,
                                  const uint64_t *laddr, const uint32_t *len, uint32_t lkey,
                                  const uint64_t *raddr, uint32_t rkey)
{
    struct ibv_sge sge[64];
    struct ibv_send_wr wr[64], *bad = NULL;
    if (n < 1 || n > 64)
        return EINVAL;
    memset(wr, 0, sizeof(struct ibv_send_wr) * (size_t)n);
    for (int i = 0; i < n; i++) {
        sge[i].addr = laddr[i];
        sge[i].length = len[i];
        sge[i].lkey = lkey;
        wr[i].wr_id = wr_id;
        wr[i].sg_list = &sge[i];
        wr[i].num_sge = 1;
        wr[i].opcode = write ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
        wr[i].send_flags = i == n - 1 ? IBV_SEND_SIGNALED : 0;
        wr[i].wr.rdma.remote_addr = raddr[i];
        wr[i].wr.rdma.rkey = rkey;
        wr[i].next = i == n - 1 ? NULL : &wr[i + 1];
    }
    return ibv_post_send(qp, wr, &bad);
}

/* Poll up to `max` completions into the three arrays. Returns the count or -1. */
static inline int duvm_poll(struct ibv_cq *cq, int max, uint64_t *wr_id, int *status,
                            int *opcode)
{
    struct ibv_wc wc[32];
    if (max > 32)
        max = 32;
    int n = ibv_poll_cq(cq, max, wc);
    for (int i = 0; i < n; i++) {
        wr_id[i] = wc[i].wr_id;
        status[i] = (int)wc[i].status;
        opcode[i] = (int)wc[i].opcode;
    }
    return n;
}

static inline int duvm_req_notify(struct ibv_cq *cq) { return ibv_req_notify_cq(cq, 0); }

/* A fresh connection parameter block: `pd_len` bytes of private data, `depth` RDMA READs in
 * flight each way (clamped by the caller to what the device allows). */
static inline void duvm_conn_param(struct rdma_conn_param *p, const void *data, uint8_t len,
                                   uint8_t depth)
{
    memset(p, 0, sizeof(*p));
    p->private_data = data;
    p->private_data_len = len;
    p->responder_resources = depth;
    p->initiator_depth = depth;
    p->retry_count = 7;
    p->rnr_retry_count = 7;
}

/* A connection event's private data (the memserver's ticket rides in a connect request). */
static inline const void *duvm_event_private_data(struct rdma_cm_event *e)
{
    return e->param.conn.private_data;
}

static inline uint8_t duvm_event_private_len(struct rdma_cm_event *e)
{
    return e->param.conn.private_data_len;
}

#endif
