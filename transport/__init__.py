"""Messages between meshvisor processes: zmq sockets, framing, serialization.

`transport` knows nothing of meshes or actors: it moves typed headers and serialized payloads
between addresses, FIFO per sender→receiver pair.
"""

from ._addresses import Addresses as Addresses
from ._addresses import host_towards as host_towards
from ._addresses import is_address as is_address
from ._arguments import dump_arguments as dump_arguments
from ._arguments import dump_value as dump_value
from ._batches import BATCH_MAGIC as BATCH_MAGIC
from ._batches import MAX_BATCH_MESSAGES as MAX_BATCH_MESSAGES
from ._contexts import close_context as close_context
from ._contexts import new_context as new_context
from ._contexts import tcp_address as tcp_address
from ._errors import MalformedMessage as MalformedMessage
from ._errors import MessageTooLarge as MessageTooLarge
from ._errors import SerializationError as SerializationError
from ._errors import TransportError as TransportError
from ._errors import WireVersionMismatch as WireVersionMismatch
from ._errors import safe_str as safe_str
from ._faults import FaultRule as FaultRule
from ._faults import NetworkFaults as NetworkFaults
from ._faults import network_faults as network_faults
from ._fds import check_fd_headroom as check_fd_headroom
from ._fds import raise_open_file_limit as raise_open_file_limit
from ._flusher import Flusher as Flusher
from ._frames import DEFAULT_MAX_MESSAGE_BYTES as DEFAULT_MAX_MESSAGE_BYTES
from ._frames import MAGIC as MAGIC
from ._frames import MAX_HEADER_BYTES as MAX_HEADER_BYTES
from ._frames import WIRE_VERSION as WIRE_VERSION
from ._frames import Envelope as Envelope
from ._frames import Payload as Payload
from ._frames import binary_header as binary_header
from ._frames import decode as decode
from ._frames import encode as encode
from ._frames import encode_fields as encode_fields
from ._frames import message_type as message_type
from ._keyed_inbox import Keyed as Keyed
from ._keyed_inbox import KeyedInbox as KeyedInbox
from ._keyed_inbox import KeyedShape as KeyedShape
from ._keyed_inbox import envelope_of as envelope_of
from ._keyed_inbox import keyed_shape as keyed_shape
from ._keyed_inbox import payload_of as payload_of
from ._lending import LEND_MIN_BYTES as LEND_MIN_BYTES
from ._lending import Lent as Lent
from ._log import get_logger as get_logger
from ._log import reset_logging as reset_logging
from ._log import warm_logging as warm_logging
from ._lone_inbox import LoneInbox as LoneInbox
from ._prepared import LoneShape as LoneShape
from ._prepared import PreparedHeader as PreparedHeader
from ._prepared import encode_prepared as encode_prepared
from ._prepared import encode_prepared_arguments as encode_prepared_arguments
from ._prepared import encode_prepared_last as encode_prepared_last
from ._prepared import encode_prepared_value as encode_prepared_value
from ._prepared import lone_shape as lone_shape
from ._prepared import prepare_header as prepare_header
from ._prepared import prepare_header_but_last as prepare_header_but_last
from ._requests import Requester as Requester
from ._requests import Responder as Responder
from ._requests import ResponderGone as ResponderGone
from ._runtime_dirs import private_runtime_dir as private_runtime_dir
from ._runtime_dirs import runtime_base_dir as runtime_base_dir
from ._security import KEYS_ENV as KEYS_ENV
from ._security import CurveKeys as CurveKeys
from ._security import check_exposure as check_exposure
from ._security import configured_keys as configured_keys
from ._security import follow_keys_pointer as follow_keys_pointer
from ._security import point_to_keys as point_to_keys
from ._serialize import OUT_OF_BAND_MIN_BYTES as OUT_OF_BAND_MIN_BYTES
from ._serialize import dumps as dumps
from ._serialize import loads as loads
from ._serialize import serializing_now as serializing_now
from ._settings import TransportSettings as TransportSettings
from ._settings import transport_settings as transport_settings
from ._settings import use_curve_keys as use_curve_keys
from ._settings import use_transport_settings as use_transport_settings
from ._sockets import Inbox as Inbox
from ._sockets import Outbox as Outbox

__all__ = (
    "BATCH_MAGIC",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "KEYS_ENV",
    "LEND_MIN_BYTES",
    "MAGIC",
    "MAX_BATCH_MESSAGES",
    "MAX_HEADER_BYTES",
    "OUT_OF_BAND_MIN_BYTES",
    "WIRE_VERSION",
    "Addresses",
    "CurveKeys",
    "Envelope",
    "FaultRule",
    "Flusher",
    "Inbox",
    "Keyed",
    "KeyedInbox",
    "KeyedShape",
    "Lent",
    "LoneInbox",
    "LoneShape",
    "MalformedMessage",
    "MessageTooLarge",
    "NetworkFaults",
    "Outbox",
    "Payload",
    "PreparedHeader",
    "Requester",
    "Responder",
    "ResponderGone",
    "SerializationError",
    "TransportError",
    "TransportSettings",
    "WireVersionMismatch",
    "binary_header",
    "check_exposure",
    "check_fd_headroom",
    "close_context",
    "configured_keys",
    "decode",
    "dump_arguments",
    "dump_value",
    "dumps",
    "encode",
    "encode_fields",
    "encode_prepared",
    "encode_prepared_arguments",
    "encode_prepared_last",
    "encode_prepared_value",
    "envelope_of",
    "follow_keys_pointer",
    "get_logger",
    "host_towards",
    "is_address",
    "keyed_shape",
    "loads",
    "lone_shape",
    "message_type",
    "network_faults",
    "new_context",
    "payload_of",
    "point_to_keys",
    "prepare_header",
    "prepare_header_but_last",
    "private_runtime_dir",
    "raise_open_file_limit",
    "reset_logging",
    "runtime_base_dir",
    "safe_str",
    "serializing_now",
    "tcp_address",
    "transport_settings",
    "use_curve_keys",
    "use_transport_settings",
    "warm_logging",
)

for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type) or callable(_obj):
        try:
            _obj.__module__ = __name__
        except (AttributeError, TypeError):
            pass
del _name, _obj
