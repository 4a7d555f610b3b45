"""NBD wire constants, and nothing else.

Values from the NBD protocol document (`doc/proto.md` of NetworkBlockDevice/nbd). Kept apart
from the codec so the numbers can be checked against the document line by line.
"""

from __future__ import annotations

import struct

# Magic numbers
NBDMAGIC = 0x4E42444D41474943  # "NBDMAGIC"
IHAVEOPT = 0x49484156454F5054  # "IHAVEOPT"
OPT_REPLY_MAGIC = 0x3E889045565A9
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698
STRUCTURED_REPLY_MAGIC = 0x668E33EF

# Handshake flags (server, 16 bits)
FLAG_FIXED_NEWSTYLE = 1 << 0
FLAG_NO_ZEROES = 1 << 1

# Client flags (32 bits)
FLAG_C_FIXED_NEWSTYLE = 1 << 0
FLAG_C_NO_ZEROES = 1 << 1

# Transmission flags (16 bits)
FLAG_HAS_FLAGS = 1 << 0
FLAG_READ_ONLY = 1 << 1
FLAG_SEND_FLUSH = 1 << 2
FLAG_SEND_FUA = 1 << 3
FLAG_ROTATIONAL = 1 << 4
FLAG_SEND_TRIM = 1 << 5
FLAG_SEND_WRITE_ZEROES = 1 << 6
FLAG_SEND_DF = 1 << 7
FLAG_CAN_MULTI_CONN = 1 << 8
FLAG_SEND_RESIZE = 1 << 9
FLAG_SEND_CACHE = 1 << 10
FLAG_SEND_FAST_ZERO = 1 << 11

# Options
OPT_EXPORT_NAME = 1
OPT_ABORT = 2
OPT_LIST = 3
OPT_PEEK_EXPORT = 4
OPT_STARTTLS = 5
OPT_INFO = 6
OPT_GO = 7
OPT_STRUCTURED_REPLY = 8
OPT_LIST_META_CONTEXT = 9
OPT_SET_META_CONTEXT = 10
OPT_EXTENDED_HEADERS = 11

# Option replies
REP_ACK = 1
REP_SERVER = 2
REP_INFO = 3
REP_META_CONTEXT = 4
REP_FLAG_ERROR = 1 << 31  # set in every error reply type
_REP_ERR = REP_FLAG_ERROR
REP_ERR_UNSUP = _REP_ERR + 1
REP_ERR_POLICY = _REP_ERR + 2
REP_ERR_INVALID = _REP_ERR + 3
REP_ERR_PLATFORM = _REP_ERR + 4
REP_ERR_TLS_REQD = _REP_ERR + 5
REP_ERR_UNKNOWN = _REP_ERR + 6
REP_ERR_SHUTDOWN = _REP_ERR + 7
REP_ERR_BLOCK_SIZE_REQD = _REP_ERR + 8
REP_ERR_TOO_BIG = _REP_ERR + 9

# Information types (NBD_REP_INFO)
INFO_EXPORT = 0
INFO_NAME = 1
INFO_DESCRIPTION = 2
INFO_BLOCK_SIZE = 3

# Commands
CMD_READ = 0
CMD_WRITE = 1
CMD_DISC = 2
CMD_FLUSH = 3
CMD_TRIM = 4
CMD_CACHE = 5
CMD_WRITE_ZEROES = 6
CMD_BLOCK_STATUS = 7

CMD_NAMES = {
    CMD_READ: "READ",
    CMD_WRITE: "WRITE",
    CMD_DISC: "DISC",
    CMD_FLUSH: "FLUSH",
    CMD_TRIM: "TRIM",
    CMD_CACHE: "CACHE",
    CMD_WRITE_ZEROES: "WRITE_ZEROES",
    CMD_BLOCK_STATUS: "BLOCK_STATUS",
}

# Command flags
CMD_FLAG_FUA = 1 << 0
CMD_FLAG_NO_HOLE = 1 << 1
CMD_FLAG_DF = 1 << 2
CMD_FLAG_REQ_ONE = 1 << 3
CMD_FLAG_FAST_ZERO = 1 << 4

# Error values (the only ones allowed on the wire)
EPERM = 1
EIO = 5
ENOMEM = 12
EINVAL = 22
ENOSPC = 28
EOVERFLOW = 75
ENOTSUP = 95
ESHUTDOWN = 108

# Fixed-size frames
REQUEST = struct.Struct(">IHHQQI")  # magic, flags, type, cookie, offset, length
REQUEST_SIZE = REQUEST.size  # 28
SIMPLE_REPLY = struct.Struct(">IIQ")  # magic, error, cookie
SIMPLE_REPLY_SIZE = SIMPLE_REPLY.size  # 16
OPTION_HEADER = struct.Struct(">QII")  # IHAVEOPT, option, length
OPTION_HEADER_SIZE = OPTION_HEADER.size  # 16
OPTION_REPLY_HEADER = struct.Struct(">QIII")  # magic, option, reply type, length

# Limits from the document: strings are at most 4096 bytes; 2^25 is the payload every
# client may assume; a minimum block size is a power of two no larger than 2^16.
MAX_STRING = 4096
DEFAULT_MAX_PAYLOAD = 1 << 25
MAX_MIN_BLOCK = 1 << 16
