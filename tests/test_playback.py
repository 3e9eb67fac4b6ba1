"""The listener model behind every stall figure: hand-made arrival sequences with known stalls."""
import pytest

from cosyvoice_triton.pipeline.playback import Playback, Stalls, stalls


def test_chunks_that_arrive_before_the_audio_runs_out_never_stall():
    # 1 s chunks arriving every 0.5 s: the listener is always ahead
    assert stalls([0.0, 0.5, 1.0, 1.5], [1.0, 1.0, 1.0, 1.0]) == Stalls(0, 0.0, 0.0)


def test_one_late_chunk_is_one_stall_of_its_lateness():
    # the first 1 s plays until 1.0; the second chunk comes at 1.25 (0.25 s late), the third in time
    result = stalls([0.0, 1.25, 1.5], [1.0, 0.5, 0.5])
    assert result.count == 1
    assert result.total_s == pytest.approx(0.25) and result.worst_s == pytest.approx(0.25)


def test_stall_at_the_second_chunk_then_playback_resumes_from_that_chunk():
    # a short first chunk (0.2 s) and a slow second one: stall at chunk 2; chunk 3 is judged against
    # playback resumed at 1.0 (plays until 2.0), so 2.5 is a second stall of 0.5 s
    result = stalls([0.0, 1.0, 2.5], [0.2, 1.0, 1.0])
    assert result.count == 2
    assert result.total_s == pytest.approx(0.8 + 0.5) and result.worst_s == pytest.approx(0.8)


def test_a_start_buffer_hides_a_short_stall():
    arrivals, durations = [0.0, 1.1], [1.0, 1.0]
    assert stalls(arrivals, durations).count == 1
    assert stalls(arrivals, durations, start_buffer_s=0.2) == Stalls(0, 0.0, 0.0)
    # ... but not a longer one: 0.3 s late minus the 0.2 s buffer
    longer = stalls([0.0, 1.3], durations, start_buffer_s=0.2)
    assert longer.count == 1 and longer.total_s == pytest.approx(0.1)


def test_lead_is_audio_sent_minus_time_since_the_first_chunk():
    playback = Playback()
    assert playback.lead(5.0) == 0.0  # nothing sent yet
    assert playback.add(10.0, 1.0) == 0.0  # the first chunk
    assert playback.lead(10.25) == pytest.approx(0.75)
    assert playback.add(10.5, 1.0) == pytest.approx(0.5)  # lead just before the second chunk
    assert playback.lead(10.5) == pytest.approx(1.5)
    assert playback.add(12.5, 0.5) == pytest.approx(-0.5)  # negative: the listener waited 0.5 s
    assert playback.summary() == Stalls(1, 0.5, 0.5)


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="2 arrival times for 1 chunks"):
        stalls([0.0, 1.0], [1.0])
