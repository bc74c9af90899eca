"""A ZeRO-3 save writes the servable weights piece by piece (train/checkpointing.py): measured on
two gloo processes (benchmarks/harness/save_memory.py), a rank's memory rises by about two of the
largest piece of the model (the piece and the gather's buffer) whatever its depth, where gathering every parameter at once costs each rank the
whole model (and rank 0 a second copy to write). The file holds exactly the gathered weights, and
a write that fails on rank 0 leaves no rank waiting in a gather."""

from harness.save_memory import measure_save_peaks, zero3_config


def test_a_zero3_save_holds_one_piece_of_the_model_at_a_time_not_the_whole(deepspeed_processes, tmp_path):
    shallow, deep = measure_save_peaks([zero3_config(n_layer=4), zero3_config(n_layer=16)], str(tmp_path))
    for row in (shallow, deep):
        assert row["equal_to_full_gather"], row
        assert row["failed_write_raised_on_rank_0_only"], row
        assert row["file_bytes"] >= row["model_bytes"]
    piece = deep["largest_piece_bytes"]  # the (tied) embedding, the same at both depths
    assert deep["model_bytes"] > 10 * piece
    # the cap: three pieces, whatever the depth; a full gather of the deep model is far over it
    assert shallow["streamed"] < 3 * piece and deep["streamed"] < 3 * piece, (shallow, deep)
    assert deep["full_gather"] > deep["model_bytes"] > 3 * 3 * piece
