"""What ds_strategy does with every key of the schema: acts on it, warns that it is ignored, or refuses it.

One table (``SUPPORT``, dotted path -> ``Support``) that the loader applies, docgen renders next to each key
in docs/config.md and a test walks (tests/config/test_support.py fails on a schema key missing here).

- ``ACTED``: the key changes what ds_strategy does (tests show the effect).
- ``WARNED``: ignored, and ignoring it changes neither results nor memory (a monitor, a profiler, a
  performance hint whose job ds_strategy does its own way). A value that asks for something gets one
  rank-0 ``IgnoredConfigWarning`` naming the key and why.
- ``REFUSED``: ignoring it would change results or memory (LoCo-ZeRO++, MiCS sharding, superchip offload
  ...): a value that asks for it is a ``ConfigError`` naming the key and why.

``when`` says which values trigger the warning or the refusal; by default every value that asks for
something (differs from the schema default, and is not a section with ``"enabled": false``).
Optimizer and scheduler ``params`` keys are listed once under ``optimizer.params.<key>`` /
``scheduler.params.<key>`` whatever the type.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .errors import ConfigProblem, format_value, join_path
from .schema import Schema, child_schema, resolve

Kind = Literal["acted", "warned", "refused"]
ACTED: Kind = "acted"
WARNED: Kind = "warned"
REFUSED: Kind = "refused"


@dataclass(frozen=True)
class Support:
    kind: Kind
    note: str = ""  # acted: what it does here (optional); warned/refused: why
    when: Callable[[Any], bool] | None = None  # which values warn/refuse (None: any value asking for something)


def _acted(note: str = "") -> Support:
    return Support(ACTED, note)


def _warned(why: str, when: Callable[[Any], bool] | None = None) -> Support:
    return Support(WARNED, why, when)


def _refused(why: str, when: Callable[[Any], bool] | None = None) -> Support:
    return Support(REFUSED, why, when)


def _is(value: Any) -> Callable[[Any], bool]:
    return lambda v: v == value


def _truthy(v: Any) -> bool:
    return v is True


_MONITOR = "monitors are not built in ds_strategy (use Lightning's loggers or your own); nothing else changes"
_PERF_ONLY = "a performance switch of DeepSpeed's implementation; ds_strategy's results and memory do not depend on it"

_NO_DEEPCOMPILE = (
    "DeepCompile (ZeRO passes inserted into the compiled graph) is not built; compile.enabled compiles the "
    "module with the engine's own gathers and reductions outside the graphs (docs/compile.md)"
)
_DEEPCOMPILE_ONLY = "a DeepCompile option, and DeepCompile is not built (compile.deepcompile is refused)"


SUPPORT: dict[str, Support] = {
    # ---------------------------------------------------------------- top level
    "train_batch_size": _acted(),
    "train_micro_batch_size_per_gpu": _acted(),
    "gradient_accumulation_steps": _acted(),
    "steps_per_print": _acted(),
    "wall_clock_breakdown": _acted(),
    "gradient_clipping": _acted(),
    "prescale_gradients": _acted(),
    "gradient_predivide_factor": _acted(),
    "gradient_allreduce_op": _acted(),
    "communication_data_type": _acted(),
    "seq_parallel_comm_data_type": _warned(
        "Ulysses' all-to-alls move the activations in their own dtype (the compute dtype); they are not cast"
    ),
    "data_types": _acted(),
    "data_types.grad_accum_dtype": _acted(),
    "data_types.param_dtype": _refused(
        "a parameter dtype override is not built; parameters use the training precision"
    ),
    "data_types.buffer_dtype": _refused("a buffer dtype override is not built; buffers use the training precision"),
    "zero_allow_untested_optimizer": _acted(),
    "zero_force_ds_cpu_optimizer": _acted(),
    "optimizer": _acted(),
    "optimizer.type": _acted(),
    "optimizer.params": _acted(),
    "optimizer.legacy_fusion": _warned(
        "a legacy fp16 kernel-fusion switch; results and memory are the same without it"
    ),
    "scheduler": _acted(),
    "scheduler.type": _acted(),
    "scheduler.params": _acted(),
    # ---------------------------------------------------------------- precision
    "fp16": _acted(),
    "fp16.enabled": _acted(),
    "fp16.auto_cast": _acted("false: inputs reach the module as given; true: floating inputs are cast to fp16"),
    "fp16.loss_scale": _acted(),
    "fp16.initial_scale_power": _acted(),
    "fp16.loss_scale_window": _acted(),
    "fp16.hysteresis": _acted(),
    "fp16.consecutive_hysteresis": _acted(),
    "fp16.min_loss_scale": _acted(),
    "fp16.fp16_master_weights_and_grads": _refused("fp16 master weights are not built; masters are always fp32"),
    "fp16.fused_mode": _warned("a legacy fp16 optimizer switch; results and memory are the same without it"),
    "bf16": _acted(),
    "bf16.enabled": _acted(),
    "bf16.immediate_grad_update": _warned(
        "each bf16 gradient is added to an fp32 gradient buffer as it arrives during backward whatever this says "
        "(what true asks for; DeepSpeed's default)"
    ),
    "bf16.check_grad_overflow": _warned(
        "ds_strategy always checks gradients for inf/nan and skips such a step, in every precision"
    ),
    "bf16.bf16_master_weights_and_grads": _refused("bf16 master weights are not built; masters are always fp32"),
    "bf16.bf16_optimizer_states": _refused("bf16 optimizer states are not built; optimizer state is fp32"),
    # ---------------------------------------------------------------- ZeRO
    "zero_optimization": _acted(),
    "zero_optimization.stage": _acted(),
    "zero_optimization.contiguous_gradients": _warned(
        "ds_strategy always accumulates gradients in contiguous flat buffers (what true asks for)",
        when=_is(False),
    ),
    "zero_optimization.overlap_comm": _acted(),
    "zero_optimization.reduce_scatter": _warned(
        "ds_strategy always reduce-scatters partitioned gradients; an all-reduce gives the same averages",
        when=_is(False),
    ),
    "zero_optimization.reduce_bucket_size": _acted("stages 0-3: elements per gradient-reduction bucket"),
    "zero_optimization.allgather_partitions": _warned(
        "ds_strategy always all-gathers updated partitions; a series of broadcasts gives the same weights",
        when=_is(False),
    ),
    "zero_optimization.allgather_bucket_size": _acted("stages 1-2: elements per all-gather of updated weights"),
    "zero_optimization.round_robin_gradients": _warned(_PERF_ONLY + " (gradient copies to the CPU)", when=_truthy),
    "zero_optimization.offload_optimizer": _acted(),
    "zero_optimization.offload_optimizer.device": _acted(
        '"cpu": masters and optimizer state in host memory; "nvme": in swap files under nvme_path (docs/nvme.md)'
    ),
    "zero_optimization.offload_optimizer.nvme_path": _acted("the directory of this rank's optimizer swap files"),
    "zero_optimization.offload_optimizer.pin_memory": _acted(),
    "zero_optimization.offload_optimizer.buffer_count": _acted(
        "host buffers, one tensor of a sub-group each: Adam holds a sub-group per 4, pipelines from 8 (nvme)"
    ),
    "zero_optimization.offload_optimizer.fast_init": _warned(
        "the swap files are always written straight from the partitions at start-up (nothing slow to skip)",
        when=_truthy,
    ),
    "zero_optimization.offload_optimizer.pipeline_read": _acted("read the next sub-group while stepping (nvme)"),
    "zero_optimization.offload_optimizer.pipeline_write": _acted("write sub-groups back behind the step (nvme)"),
    "zero_optimization.offload_optimizer.ratio": _acted(
        "device cpu, stages 1-3: the share of each param group's masters and optimizer state kept and stepped on "
        "the host, in whole buckets; the rest steps on the compute device, overlapped (docs/finetuning.md)"
    ),
    "zero_optimization.offload_optimizer.super_offload": _refused("the superchip offload path is not built"),
    "zero_optimization.offload_optimizer.convert_grad_on_cpu": _warned(_PERF_ONLY),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": _warned(
        "only used by super_offload, which is refused; ds_strategy's CPU optimizer uses OpenMP's threads"
    ),
    "zero_optimization.offload_param": _acted(),
    "zero_optimization.offload_param.device": _acted(
        '"cpu": partitions in host memory; "nvme": in swap files under nvme_path, read ahead of use (docs/nvme.md)'
    ),
    "zero_optimization.offload_param.nvme_path": _acted("the directory of this rank's parameter swap files"),
    "zero_optimization.offload_param.pin_memory": _acted(),
    "zero_optimization.offload_param.buffer_count": _acted("parameter partitions read ahead (at most; nvme)"),
    "zero_optimization.offload_param.buffer_size": _acted(
        "elements per read-ahead buffer; buffer_count x buffer_size bounds the read-ahead (nvme)"
    ),
    "zero_optimization.offload_param.max_in_cpu": _acted("partition elements kept in host memory, not swapped (nvme)"),
    "zero_optimization.sub_group_size": _acted(
        "the optimizer steps the masters in tiles of at most this many elements"
    ),
    "zero_optimization.stage3_prefetch_bucket_size": _acted(),
    "zero_optimization.stage3_param_persistence_threshold": _acted(),
    "zero_optimization.stage3_model_persistence_threshold": _acted(),
    "zero_optimization.stage3_max_live_parameters": _acted(),
    "zero_optimization.stage3_max_reuse_distance": _acted(),
    "zero_optimization.stage3_fetch_units": _acted("ds_strategy's own key: the fetch units of stage 3 (zero3.md)"),
    "zero_optimization.stage3_tile_frozen": _acted("ds_strategy's own key: large frozen weights tiled (zero3.md)"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": _acted(),
    "zero_optimization.load_from_fp32_weights": _refused(
        "loading the fp32 masters from the checkpoint's 16-bit weights is not built; checkpoints always "
        "restore the fp32 masters",
        when=_is(False),
    ),
    "zero_optimization.ignore_unused_parameters": _acted(
        "false: a step raises when a trainable parameter got no gradient in the accumulation window"
    ),
    "zero_optimization.use_multi_rank_bucket_allreduce": _warned(_PERF_ONLY, when=_is(False)),
    "zero_optimization.elastic_checkpoint": _warned(
        "ds_strategy checkpoints load at any world size and stage already", when=_truthy
    ),
    "zero_optimization.legacy_stage1": _warned("an old implementation of the same stage 1 arithmetic", when=_truthy),
    "zero_optimization.zero_hpz_partition_size": _acted(
        "stage 3: a secondary partition inside each group of this many ranks serves backward's gathers (docs/zeropp.md)"
    ),
    "zero_optimization.zero_quantized_weights": _acted(
        "stage 3: int8 block-quantized parameter all-gathers (docs/zeropp.md)"
    ),
    "zero_optimization.zero_quantized_nontrainable_weights": _acted(
        "stage 3: frozen parameters rest as int8 partitions and are gathered quantized (docs/zeropp.md)"
    ),
    "zero_optimization.zero_quantized_gradients": _acted(
        "stage 3: gradients reduced by int4/int8 quantized all-to-alls with fp32 accumulation (docs/zeropp.md)"
    ),
    "zero_optimization.zeropp_loco_param": _refused("LoCo-ZeRO++ is not built"),
    "zero_optimization.mics_shard_size": _refused(
        "MiCS sharding groups are not built; parameters are partitioned across all data-parallel ranks",
        when=lambda v: isinstance(v, int) and v > 0,
    ),
    "zero_optimization.mics_hierarchical_params_gather": _warned(
        "only used with mics_shard_size, which is refused", when=_truthy
    ),
    "zero_optimization.memory_efficient_linear": _warned(
        "ds_strategy's stage 3 gathers weights again for backward with ordinary nn.Linear; no replacement is needed",
        when=_is(False),
    ),
    "zero_optimization.pipeline_loading_checkpoint": _warned(_PERF_ONLY, when=_truthy),
    "zero_optimization.override_module_apply": _warned(
        "ds_strategy does not patch nn.Module.apply; use GatheredParameters to edit partitioned weights",
        when=_is(False),
    ),
    "zero_optimization.log_trace_cache_warnings": _warned("a DeepSpeed log switch", when=_truthy),
    "zero_optimization.enable_sanity_checks": _warned("DeepSpeed's internal checks", when=_truthy),
    "zero_optimization.save_muon_momentum_buffer_in_memory": _warned(
        "ds_strategy refuses NVMe optimizer offload with Muon (per-tensor optimizers), so no Muon momentum is swapped",
        when=_truthy,
    ),
    "zero_optimization.leaf_module": _acted("stage 3 gathers each marked module's subtree as one unit"),
    "zero_optimization.leaf_module.classes": _acted(),
    "zero_optimization.leaf_module.names": _acted(),
    "zero_optimization.leaf_module.name_suffixes": _acted(),
    "zero_optimization.zenflow": _refused("ZenFlow asynchronous offload is not built"),
    "zero_optimization.stage3_module_granularity_threshold": _refused(
        "marking fine-grained modules as leaves by a size threshold is not built; list them in "
        "zero_optimization.leaf_module instead",
        when=lambda v: isinstance(v, int) and v > 0,
    ),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": _warned(_PERF_ONLY, when=_truthy),
    "zero_optimization.stage3_allgather_sequential": _warned(_PERF_ONLY, when=_truthy),
    "zero_optimization.stage3_partition_stream_chunk_size": _refused(
        "streaming large parameters through chunks at zero.Init is not built",
        when=lambda v: isinstance(v, int) and v > 0,
    ),
    "zero_optimization.compute_grad_norm": _warned(
        "ds_strategy always computes the global gradient norm (clipping and overflow detection need it)",
        when=_is(False),
    ),
    "zero_optimization.parameter_alignment": _warned(
        "ds_strategy aligns every shard to 16 elements already", when=_truthy
    ),
    # ---------------------------------------------------------------- activation checkpointing
    "activation_checkpointing": _acted("the block itself; see its keys"),
    "activation_checkpointing.partition_activations": _acted(
        "ds_strategy.checkpointing splits checkpoint inputs across the mpu's model-parallel group (a one-time "
        "rank-0 message says so when there is none)"
    ),
    "activation_checkpointing.cpu_checkpointing": _acted(
        "checkpoint inputs move to host memory until their recomputation (a one-time message on CPU training)"
    ),
    "activation_checkpointing.contiguous_memory_optimization": _acted(
        "partitioned checkpoint inputs go to buffers reused every forward"
    ),
    "activation_checkpointing.number_checkpoints": _acted("sizes the contiguous buffers"),
    "activation_checkpointing.synchronize_checkpoint_boundary": _acted("device sync at each checkpoint boundary"),
    "activation_checkpointing.profile": _acted("checkpointing.profile_report(): forward and recompute times"),
    # ---------------------------------------------------------------- logging and checkpoints
    "comms_logger": _acted(),
    "comms_logger.enabled": _acted(),
    "comms_logger.verbose": _acted(),
    "comms_logger.prof_all": _acted(),
    "comms_logger.debug": _acted(),
    "comms_logger.prof_ops": _acted(),
    "checkpoint": _acted(),
    "checkpoint.tag_validation": _acted(
        "ranks saving under different tags: Fail raises, Warn warns and saves under rank 0's tag, Ignore "
        "saves under rank 0's tag"
    ),
    "checkpoint.load_universal": _warned(
        "ds_strategy's checkpoints load at any world size and stage without conversion; DeepSpeed universal "
        "checkpoints are not read (loading one fails with a CheckpointError)"
    ),
    "checkpoint.use_node_local_storage": _warned(
        "ds_strategy saves correctly with or without a shared filesystem (one rank per node manages each "
        "node's directory); loading needs every node's files in one directory, and a missing shard is an error "
        "naming it"
    ),
    "checkpoint.parallel_write": _warned(
        "pipeline-parallel checkpoint writing: each stage writes its own layer files anyway"
    ),
    "checkpoint.writer": _warned(_PERF_ONLY + " (the checkpoint writer backend)"),
    # ---------------------------------------------------------------- accepted-but-ignored DeepSpeed keys
    "dump_state": _warned("prints DeepSpeed's engine state; nothing else changes"),
    "memory_breakdown": _warned("use engine.memory_breakdown() instead; nothing else changes"),
    "sparse_gradients": _warned(
        "ds_strategy reduces embedding gradients densely (an nn.Embedding(sparse=True) trains, its gradient "
        "densified into the flat buffers); the averages are the same"
    ),
    "disable_allgather": _warned(_PERF_ONLY),
    "graph_harvesting": _warned(_PERF_ONLY),
    "vocabulary_size": _warned("only an alignment hint for DeepSpeed's kernels"),
    "dataloader_drop_last": _refused(
        "initialize(training_data=...) builds its DataLoader without drop_last; drop the last batch in your "
        "own DataLoader"
    ),
    "managed_gradient_accumulation": _warned(
        "ds_strategy's engine always tracks accumulation boundaries", when=_is(False)
    ),
    "disable_python_gc": _warned(_PERF_ONLY),
    "sequence_parallel_size": _acted(
        "Ulysses sequence parallelism over consecutive groups of this many ranks (docs/sequence_parallel.md)"
    ),
    "use_data_before_expert_parallelism": _warned(
        "ds_strategy.moe.MoE's expert groups always use DeepSpeed's default order (expert-parallel ranks consecutive, "
        "expert-data-parallel ranks strided); the data-before-expert order is not built"
    ),
    "log_level": _warned("DeepSpeed's logger level; set the 'ds_strategy' logger's level instead"),
    "amp": _refused("NVIDIA Apex AMP is not built; use fp16 or bf16"),
    "torch_autocast": _refused("engine-driven torch.autocast is not built; use fp16 or bf16 (or autocast yourself)"),
    "tensorboard": _warned(_MONITOR),
    "wandb": _warned(_MONITOR),
    "comet": _warned(_MONITOR),
    "csv_monitor": _warned(_MONITOR),
    "flops_profiler": _acted("the flops profiler (docs/profiling.md)"),
    "flops_profiler.enabled": _acted("profile one step's forward and print it on rank 0"),
    "flops_profiler.recompute_fwd_factor": _acted("a step's flops = (3 + factor) x forward flops (MFU, summary)"),
    "flops_profiler.profile_step": _acted("the global step whose forward is profiled"),
    "flops_profiler.module_depth": _acted("deepest level of the per-depth summary"),
    "flops_profiler.top_modules": _acted("module types per depth in the summary"),
    "flops_profiler.detailed": _acted("print the per-module table"),
    "flops_profiler.output_file": _acted("write the profile to this file"),
    "autotuning": _acted("ds_strategy.autotune() and ds-launch --autotuning"),
    "autotuning.enabled": _acted("ds-launch --autotuning and ZeroStrategy(autotune=True) tune first"),
    "autotuning.metric": _acted('what ranks the trials; DeepSpeed\'s "forward" and "step(s)" are refused'),
    "autotuning.start_profile_step": _acted("the first timed optimizer step of each trial"),
    "autotuning.end_profile_step": _acted("the last optimizer step of each trial"),
    "autotuning.fast": _acted("false: also tune bucket sizes, overlap_comm and stage 3's prefetch"),
    "autotuning.max_train_batch_size": _acted("a config whose global batch is above it is not tuned"),
    "autotuning.min_train_batch_size": _warned(
        "the tuner holds the configured global batch, so a lower bound on the batch it may pick changes nothing",
        when=lambda v: v != 1,
    ),
    "autotuning.max_train_micro_batch_size_per_gpu": _acted("the largest micro batch tried"),
    "autotuning.min_train_micro_batch_size_per_gpu": _acted("the smallest micro batch tried"),
    "autotuning.num_tuning_micro_batch_sizes": _acted("micro batches tried per configuration"),
    "autotuning.tuner_type": _acted('"gridsearch" ("grid"), "random" or "model_based"'),
    "autotuning.tuner_early_stopping": _acted("trials in a row without a better one before the tune stops"),
    "autotuning.tuner_num_trials": _acted("the most trials run"),
    "autotuning.results_dir": _acted("the trials' JSON, table, plot and the winning ds_config.json"),
    "autotuning.exps_dir": _acted("each trial's ds_config"),
    "autotuning.overwrite": _acted("false: reuse the trials an earlier tune wrote"),
    "autotuning.mp_size": _refused(
        "ds_strategy tunes data-parallel ZeRO configurations; model parallelism is not tuned", when=lambda v: v != 1
    ),
    "autotuning.max_memory_per_rank": _acted('a trial above this cap does not fit (bytes, "16GB", "auto")'),
    "autotuning.time_budget_s": _acted("no trial starts after this many seconds"),
    "autotuning.confirm_top": _acted("the best fitted trials run once more, ranked by both runs"),
    "autotuning.arg_mappings": _refused("ds_strategy tunes in-process: no command line is rewritten"),
    "autotuning.model_info": _refused("the model is profiled in-process at the start of the tune"),
    "autotuning.model_info_path": _refused("the model is profiled in-process at the start of the tune"),
    "autotuning.metric_path": _refused("trial metrics stay in memory and go to results_dir"),
    "aio": _acted("the asynchronous I/O engine of NVMe offload (docs/nvme.md)"),
    "aio.block_size": _acted("bytes per I/O request (one read or write per block)"),
    "aio.queue_depth": _acted(
        "I/O requests each I/O thread keeps in flight at the device (io_uring / Linux AIO; 1 on the blocking fallback)"
    ),
    "aio.thread_count": _acted("I/O threads, each with queue_depth requests in flight"),
    "aio.intra_op_parallelism": _acted("I/O threads (DeepSpeed's newer name for thread_count)"),
    "aio.single_submit": _acted("issue requests to the kernel one system call each instead of in batches"),
    "aio.overlap_events": _acted("overlap I/O with compute (false: every request completes before it returns)"),
    "aio.use_gds": _refused("GPUDirect Storage is not built; NVMe offload reads and writes through host memory"),
    "elasticity": _refused("elastic training (DeepSpeed choosing the batch size) is not built"),
    "compression_training": _refused("the compression library is not built"),
    "sparse_attention": _refused("sparse attention kernels are not built"),
    "data_efficiency": _refused("curriculum learning and random-LTD are not built"),
    "curriculum_learning": _refused("curriculum learning is not built"),
    "progressive_layer_drop": _refused("progressive layer dropping is not built"),
    "eigenvalue": _refused("the eigenvalue computation for MoQ is not built"),
    "quantize_training": _refused("quantisation-aware training (MoQ) is not built"),
    "pipeline": _acted("read by the PipelineEngine that initialize() builds for a PipelineModule (docs/pipeline.md)"),
    "pipeline.stages": _acted("checked against the PipelineModule's num_stages (a mismatch raises)"),
    "pipeline.partition": _warned("the partition is PipelineModule(partition_method=...)", when=lambda v: v != "best"),
    "pipeline.seed_layers": _warned("layer seeding is PipelineModule(seed_layers=...)", when=_truthy),
    "pipeline.activation_checkpoint_interval": _acted("above 0 it overrides the PipelineModule's interval"),
    "pipeline.pipe_partitioned": _warned(
        "partitions activations over a tensor-parallel group; there is none, stages send whole activations",
        when=lambda v: v is False,
    ),
    "pipeline.grad_partitioned": _warned(
        "partitions gradients over a tensor-parallel group; there is none, stages send whole gradients",
        when=lambda v: v is False,
    ),
    "pipeline.use_reentrant": _acted("false: the pipeline layers use the non-reentrant activation checkpoint"),
    "hybrid_engine": _acted("engine.generate() (docs/hybrid_engine.md)"),
    "hybrid_engine.enabled": _acted("stage 3: gather every partitioned parameter once per engine.generate() call"),
    "hybrid_engine.max_out_tokens": _acted("prompt + new tokens above it make engine.generate() raise"),
    "hybrid_engine.inference_tp_size": _acted(
        "engine.generate() runs tensor-parallel over groups of this many consecutive ranks, following the "
        "model's tensor-parallel plan (runtime/inference_tp.py)"
    ),
    "hybrid_engine.release_inference_cache": _acted(
        "after each generate the cached gathered-bucket buffers (host pool, CUDA cache) are returned"
    ),
    "hybrid_engine.pin_parameters": _acted("keep the gathered parameters until the next optimizer step"),
    "hybrid_engine.tp_gather_partition_size": _acted("bucket all-gathers in flight at once in the one-time gather"),
    "hybrid_engine.enable_cuda_graph": _warned(_PERF_ONLY + " (CUDA graphs of the decoding steps)"),
    "tensor_parallel": _refused("AutoTP tensor parallelism is not built"),
    "expert_parallel": _refused(
        "AutoEP (automatic expert parallelism of Hugging Face MoE blocks) is not built; ds_strategy.moe.MoE layers "
        "give expert parallelism through their ep_size (docs/moe.md)"
    ),
    "compile": _acted("torch.compile through the engine (docs/compile.md)"),
    "compile.enabled": _acted("compile when the engine is built: stages 0-2 the module's forward, stage 3 each block"),
    "compile.backend": _acted("the torch.compile backend; an unknown name is a ConfigError listing the valid ones"),
    "compile.kwargs": _acted("passed to torch.compile (fullgraph, dynamic, mode, options)"),
    "compile.deepcompile": _refused(_NO_DEEPCOMPILE),
    "compile.passes": _refused(_NO_DEEPCOMPILE, when=lambda v: bool(v)),
    "compile.autoep_non_moe": _refused("AutoEP expert parallelism is not built, so there are no AutoEP layers"),
    "compile.free_activation": _warned(_DEEPCOMPILE_ONLY),
    "compile.free_activation_threshold": _warned(_DEEPCOMPILE_ONLY),
    "compile.offload_activation": _refused(_DEEPCOMPILE_ONLY + "; ignoring an offload would change memory"),
    "compile.offload_activation_pin_memory": _warned(_DEEPCOMPILE_ONLY),
    "compile.offload_opt_states": _refused(_DEEPCOMPILE_ONLY + "; ignoring an offload would change memory"),
    "compile.offload_parameters": _refused(_DEEPCOMPILE_ONLY + "; ignoring an offload would change memory"),
    "compile.double_buffer": _warned(_DEEPCOMPILE_ONLY),
    "compile.symmetric_memory": _warned(_DEEPCOMPILE_ONLY),
    "compile.debug_log": _warned(_DEEPCOMPILE_ONLY + " (TORCH_LOGS=graph_code shows the graphs)"),
    "compile.sync_before_reduce": _warned(_DEEPCOMPILE_ONLY),
    "compile.sync_after_reduce": _warned(_DEEPCOMPILE_ONLY),
    "compile.sync_before_allgather": _warned(_DEEPCOMPILE_ONLY),
    "compile.sync_after_allgather": _warned(_DEEPCOMPILE_ONLY),
    "compile.keep_int_input_tensors": _warned(_DEEPCOMPILE_ONLY),
    "compile.keep_all_input_tensors": _warned(_DEEPCOMPILE_ONLY),
    "nebula": _warned("the Nebula checkpoint service is not built; checkpoints are written by ds_strategy"),
    "datastates": _warned("the DataStates checkpoint engine is not built; checkpoints are written by ds_strategy"),
    "weight_quantization": _refused("weight quantisation is not built"),
    "timers": _warned("DeepSpeed's timer settings; wall_clock_breakdown times the phases here"),
}

# Optimizer and scheduler params, whatever the type (the schema lists them per type).
_OPTIMIZER_PARAMS_ACTED = [
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "bias_correction",
    "adam_w_mode",
    "torch_adam",
    "fused",
    "foreach",
    "maximize",
    "capturable",
    "differentiable",
    "decoupled_weight_decay",
    "lr_decay",
    "initial_accumulator_value",
    "momentum",
    "dampening",
    "nesterov",
    # Muon (MuonWithAuxAdam) and Adafactor: torch.optim's arguments
    "ns_steps",
    "ns_coefficients",
    "adjust_lr_fn",
    "adam_lr",
    "muon_lr",
    "adam_betas",
    "adam_eps",
    "adam_weight_decay",
    "beta2_decay",
    "d",
]
SUPPORT.update({f"optimizer.params.{k}": _acted() for k in _OPTIMIZER_PARAMS_ACTED})
SUPPORT["optimizer.params.torch_adam"] = _acted(
    "true: torch.optim's Adam/AdamW instead of ds_strategy's fused kernel (except with optimizer offload, as in "
    "DeepSpeed)"
)
SUPPORT["optimizer.params.set_grad_none"] = _warned(
    "the engine owns the gradients and drops the optimizer's gradients after every step, which is what "
    "set_grad_none asks of DeepSpeed's fused optimizers; false would only change an optimizer.zero_grad() "
    "that ZeRO never calls",
    when=_is(False),
)
SUPPORT["optimizer.params.ns_method"] = _warned(
    "ds_strategy's Muon runs torch.optim.Muon's quintic Newton-Schulz iteration (ns_steps, ns_coefficients) "
    "whatever variant ns_method names",
    when=lambda v: True,
)
SUPPORT["optimizer.params.max_grad_norm"] = _warned(
    "not an optimizer argument in DeepSpeed either; use the top-level gradient_clipping", when=lambda v: True
)
_SCHEDULER_PARAMS = [
    "warmup_min_lr",
    "warmup_max_lr",
    "warmup_num_steps",
    "warmup_type",
    "last_batch_iteration",
    "total_num_steps",
    "warmup_min_ratio",
    "cos_min_ratio",
    "cycle_min_lr",
    "cycle_max_lr",
    "decay_lr_rate",
    "cycle_first_step_size",
    "cycle_second_step_size",
    "cycle_first_stair_count",
    "cycle_second_stair_count",
    "decay_step_size",
    "cycle_momentum",
    "cycle_min_mom",
    "cycle_max_mom",
    "decay_mom_rate",
    "lr_range_test_min_lr",
    "lr_range_test_step_size",
    "lr_range_test_step_rate",
    "lr_range_test_staircase",
]
SUPPORT.update({f"scheduler.params.{k}": _acted() for k in _SCHEDULER_PARAMS})


def support_of(path: str) -> Support | None:
    """The entry of a dotted schema path (``optimizer.params.lr``, ``zero_optimization.stage``)."""
    return SUPPORT.get(path)


def label(entry: Support) -> str:
    """How docs/config.md shows an entry: ``acted on``, ``warned: why``, ``refused: why``."""
    if entry.kind == ACTED:
        return "acted on" + (f": {entry.note}" if entry.note else "")
    return f"{entry.kind}: {entry.note}"


# --------------------------------------------------------------------------------------------------
# Applying the table to a resolved config


def _asks_for_something(value: Any) -> bool:
    if isinstance(value, Mapping):
        if "enabled" in value:
            return value["enabled"] not in (False, None, "false", "False")
        return any(_asks_for_something(v) for v in value.values())
    return value not in (None, False, "", [], {}) and value != "false"


def _triggers(entry: Support, value: Any, node: Mapping[str, Any]) -> bool:
    if entry.when is not None:
        return bool(entry.when(value))
    if "default" in node and value == node["default"]:
        return False
    return _asks_for_something(value)


def _walk(config: Mapping[str, Any], node: Schema, path: str) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """(dotted path, value, schema node) of every key present in ``config``."""
    node = resolve(node)
    for key, value in config.items():
        child = child_schema(node, key, config)
        if child is None:
            continue
        full = join_path(path, key)
        yield full, value, child
        if isinstance(value, Mapping) and not child.get("x-ignored"):
            yield from _walk(value, child, full)


def classify(config: Mapping[str, Any], schema: Schema) -> tuple[list[ConfigProblem], list[str]]:
    """(refusals, warnings) for a resolved, default-filled config that still holds its ignored keys."""
    refusals: list[ConfigProblem] = []
    notes: list[str] = []
    for path, value, node in _walk(config, schema, ""):
        entry = SUPPORT.get(path)
        if entry is None or entry.kind == ACTED or not _triggers(entry, value, node):
            continue
        shown = format_value(value)
        if entry.kind == REFUSED:
            refusals.append(
                ConfigProblem(
                    path, f"{shown} is not supported by ds_strategy: {entry.note}; remove the key or change it"
                )
            )
        else:
            notes.append(f"{path} ({shown}) is accepted but ignored: {entry.note} (remove it to silence this warning)")
    return refusals, notes
