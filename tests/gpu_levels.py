"""The GPU suite's levels (docs/guide.md#tests): which test of each GPU test file is its subsystem's `smoke`
test, and which files need two GPUs (`two_gpu`). conftest.py marks the collected items from these tables.

    python3 -m pytest -m "gpu and smoke"          # every subsystem once, one GPU, minutes
    python3 -m pytest -m "gpu and not two_gpu"    # the full one-GPU suite
    python3 -m pytest -m two_gpu                  # the tests that need two GPUs (they skip with fewer)
"""

from __future__ import annotations

# file: the test function whose first collected case (its first parametrisation) is that file's smoke test
SMOKE = {
    "test_gpu_autotune.py": "test_autotuned_plan_is_not_slower_than_the_heuristic_choice",
    "test_gpu_batchnorm_kernels.py": "test_reductions_and_backward_pass_match_float64",
    "test_gpu_cache.py": "test_first_process_builds_and_writes",
    "test_gpu_calls.py": "test_no_device_synchronisation_on_any_call_path",
    "test_gpu_capture.py": "test_captured_steps_equal_eager_steps_bit_for_bit",
    "test_gpu_chain.py": "test_chain_matches_torch_in_float64",
    "test_gpu_cnblock_train.py": "test_the_node_matches_float64_as_closely_as_torchs_amp_block",
    "test_gpu_conv.py": "test_fwd_bias_activation",
    "test_gpu_fallback_calls.py": "test_no_device_synchronisation",
    "test_gpu_gemm_act.py": "test_against_torch_float64",
    "test_gpu_grid_sample.py": "test_full_matrix_small",
    "test_gpu_layernorm.py": "test_the_kernel_matches_float64",
    "test_gpu_mlp.py": "test_mlp_matches_torch_float64",
    "test_gpu_preact.py": "test_fused_against_float64",
    "test_gpu_remote_cache.py": "test_two_fresh_processes_plan_the_preset_from_a_warm_remote_with_zero_builds",
    "test_gpu_requests.py": "test_conv_fwd_helper_matches_torch_and_keeps_layout",
    "test_gpu_se.py": "test_forward_and_dx_are_torchs_bits_and_ds_is_as_close_to_float64",
    "test_gpu_torch_conv.py": "test_modules_match_torch",
    "test_gpu_torch_convert.py": "test_inference_convert_matches_eval_torch_in_fp16",
    "test_gpu_torch_flags.py": "test_cudnn_disabled_runs_torchs_convolution_and_enabling_it_plans_again",
}
# files whose tests need two GPUs: a level of their own (the smoke level is one GPU's)
TWO_GPU = {"test_gpu_ddp.py", "test_gpu_warmup_devices.py"}


def mark(items, smoke, two_gpu) -> None:
    """Add the `smoke` marker to each SMOKE file's first collected case of its test, `two_gpu` to every
    item of a TWO_GPU file."""
    seen = set()
    for item in items:
        file = item.path.name
        function = getattr(item, "originalname", None) or item.name.split("[")[0]
        if file in TWO_GPU:
            item.add_marker(two_gpu)
        elif SMOKE.get(file) == function and file not in seen:
            seen.add(file)
            item.add_marker(smoke)
