"""zmqworker's wire contract: message types, the codec and the protocol version.

Nothing here imports zmqworker: an engine can depend on this package alone.
"""

from messages.codec import INLINE_MAX_BYTES, Decoder, Encoder
from messages.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    ProfilerConfig,
    SchedulerConfig,
    WorkerConfig,
)
from messages.engine_core import (
    AbortRequests,
    EngineCoreConfig,
    EngineCoreFailure,
    EngineCoreHello,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreStats,
    UtilityCall,
    UtilityResult,
    UtilityValue,
    WorkerCall,
)
from messages.errors import ProtocolError
from messages.kinds import Message
from messages.kv_cache import (
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    KVCacheTensor,
    make_kv_cache_config,
)
from messages.rpc import (
    ALL_RANKS,
    Hello,
    Ping,
    PipelineSharedTensors,
    PipelineTensors,
    RemoteError,
    RpcReply,
    RpcRequest,
    SharedSlot,
    SharedTensorRef,
    Value,
    Welcome,
)
from messages.sampling import SamplingParams
from messages.step import (
    CachedRequestData,
    GrammarOutput,
    IntermediateTensors,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from messages.structured_outputs import StructuredOutputsParams
from messages.version import PROTOCOL_VERSION
from messages.weights import (
    CudaWeightRef,
    CudaWeights,
    SharedWeightRef,
    SharedWeights,
    WeightSpec,
    WeightUpdate,
)

__all__ = [
    "ALL_RANKS",
    "AbortRequests",
    "INLINE_MAX_BYTES",
    "PROTOCOL_VERSION",
    "CacheConfig",
    "CachedRequestData",
    "CudaWeightRef",
    "CudaWeights",
    "Decoder",
    "DeviceConfig",
    "Encoder",
    "EngineCoreConfig",
    "EngineCoreFailure",
    "EngineCoreHello",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreReady",
    "EngineCoreRequest",
    "EngineCoreStats",
    "GrammarOutput",
    "Hello",
    "IntermediateTensors",
    "KVCacheConfig",
    "KVCacheGroup",
    "KVCacheSpec",
    "KVCacheTensor",
    "LogprobsLists",
    "Message",
    "ModelConfig",
    "ModelRunnerOutput",
    "NewRequestData",
    "ParallelConfig",
    "PipelineSharedTensors",
    "PipelineTensors",
    "Ping",
    "ProfilerConfig",
    "ProtocolError",
    "RemoteError",
    "RpcReply",
    "RpcRequest",
    "SamplingParams",
    "StructuredOutputsParams",
    "SchedulerConfig",
    "SchedulerOutput",
    "SharedSlot",
    "SharedTensorRef",
    "SharedWeightRef",
    "SharedWeights",
    "UtilityCall",
    "UtilityResult",
    "UtilityValue",
    "Value",
    "WeightSpec",
    "WeightUpdate",
    "Welcome",
    "WorkerCall",
    "WorkerConfig",
    "make_kv_cache_config",
]
