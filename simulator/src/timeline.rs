//! The series a report draws, sampled as a run or a replay goes: GPU utilization, queue depth,
//! nodes up, faults and invariant checks over (simulated or logged) time, and the moments to
//! mark (the first failure, the replay's `--until`, the liveness phase's start). Pure: the
//! caller observes, this keeps a bounded record.
//!
//! **Bounded.** At most [`SAMPLES_MAX`] samples, whatever the length of the run: observations
//! are merged `stride` at a time, and whenever the record is full, neighbours are merged in
//! pairs and the stride doubles. Each sample is then exactly `stride` observations (the last one
//! fewer), so the merge is exact: utilization is their mean, the queue depth their most, nodes
//! up their fewest (an outage stays visible however long the run), and the cumulative counters
//! (faults, checks) their last.
//!
//! **Outside the run's decisions.** Observing reads state and draws nothing from the seed, so a
//! run makes the same decisions and the same digest with or without a timeline
//! (`run::tests::a_timeline_changes_nothing_the_run_decides`).

/// Samples kept at most (each is a handful of numbers; the report draws one point per sample).
pub const SAMPLES_MAX: usize = 2000;
const _: () = assert!(SAMPLES_MAX >= 2 && SAMPLES_MAX.is_multiple_of(2));

/// One observation, or several merged.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sample {
    /// Milliseconds since the timeline's start (merged: the earliest).
    pub at_ms: u64,
    /// GPUs held by active reservations over every GPU, 0 to 1 (merged: the mean).
    pub gpu_utilization: f64,
    /// Reservations waiting in a queue (merged: the most).
    pub queue_depth: u64,
    /// Nodes up (merged: the fewest).
    pub nodes_up: u64,
    /// Faults so far (cumulative; merged: the last).
    pub faults: u64,
    /// Invariant checks passed so far (cumulative; merged: the last).
    pub checks: u64,
}

impl Sample {
    /// `self` (of `n` observations) and `later` (of `m`) as one sample of `n + m`.
    fn merged(self, n: u64, later: Sample, m: u64) -> Sample {
        let total = (n + m).max(1) as f64;
        Sample {
            at_ms: self.at_ms.min(later.at_ms),
            gpu_utilization: (self.gpu_utilization * n as f64 + later.gpu_utilization * m as f64) / total,
            queue_depth: self.queue_depth.max(later.queue_depth),
            nodes_up: self.nodes_up.min(later.nodes_up),
            faults: later.faults,
            checks: later.checks,
        }
    }
}

/// What a mark on the timeline is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MarkKind {
    /// The run's first broken invariant.
    Failure,
    /// The seq a replay's state is at (`--until`, or the file's last).
    Until,
    /// The run's liveness phase begins: faults and the workload stop.
    Liveness,
    /// A replay's what-if decides otherwise than the control plane did, for the first time.
    Divergence,
}

impl MarkKind {
    /// The mark's id in the report (`mark-failure`, …).
    pub fn id(self) -> &'static str {
        match self {
            MarkKind::Failure => "mark-failure",
            MarkKind::Until => "mark-until",
            MarkKind::Liveness => "mark-liveness",
            MarkKind::Divergence => "mark-divergence",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Mark {
    pub kind: MarkKind,
    /// Milliseconds since the timeline's start.
    pub at_ms: u64,
    /// What happened there, for a person.
    pub label: String,
}

/// The bounded record of a run's or a replay's series.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    /// Whole buckets of `stride` observations each.
    samples: Vec<Sample>,
    /// The bucket being filled, and how many observations it has.
    bucket: Option<(Sample, u64)>,
    stride: u64,
    observed: u64,
    last_at_ms: u64,
    pub marks: Vec<Mark>,
}

impl Default for Timeline {
    fn default() -> Self {
        Self { samples: Vec::new(), bucket: None, stride: 1, observed: 0, last_at_ms: 0, marks: Vec::new() }
    }
}

impl Timeline {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one observation (its `at_ms` at or after the previous one's; an earlier one is
    /// taken as the previous one's time, so the time axis never runs backwards).
    pub fn observe(&mut self, mut sample: Sample) {
        sample.at_ms = sample.at_ms.max(self.last_at_ms);
        self.last_at_ms = sample.at_ms;
        self.observed += 1;
        let (bucket, n) = match self.bucket.take() {
            None => (sample, 1),
            Some((bucket, n)) => (bucket.merged(n, sample, 1), n + 1),
        };
        if n < self.stride {
            self.bucket = Some((bucket, n));
            return;
        }
        self.samples.push(bucket);
        if self.samples.len() == SAMPLES_MAX {
            let stride = self.stride;
            self.samples = self.samples.chunks(2).map(|pair| pair[0].merged(stride, pair[1], stride)).collect();
            self.stride *= 2;
        }
    }

    pub fn mark(&mut self, kind: MarkKind, at_ms: u64, label: impl Into<String>) {
        self.marks.push(Mark { kind, at_ms, label: label.into() });
    }

    /// The samples in time order, the partly filled last one included: at most [`SAMPLES_MAX`].
    pub fn samples(&self) -> Vec<Sample> {
        let mut out = self.samples.clone();
        out.extend(self.bucket.map(|(s, _)| s));
        out
    }

    /// Observations recorded in all.
    pub fn observed(&self) -> u64 {
        self.observed
    }

    /// Observations per sample now.
    pub fn stride(&self) -> u64 {
        self.stride
    }

    /// The last observation's time: where the timeline ends.
    pub fn end_ms(&self) -> u64 {
        self.last_at_ms.max(self.marks.iter().map(|m| m.at_ms).max().unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(i: u64) -> Sample {
        Sample {
            at_ms: i * 10,
            gpu_utilization: (i % 10) as f64 / 10.0,
            queue_depth: i % 7,
            nodes_up: 100 - i % 5,
            faults: i / 3,
            checks: i,
        }
    }

    #[test]
    fn a_short_timeline_keeps_every_observation() {
        let mut t = Timeline::new();
        for i in 0..10 {
            t.observe(sample(i));
        }
        assert_eq!(t.samples(), (0..10).map(sample).collect::<Vec<_>>());
        assert_eq!((t.observed(), t.stride(), t.end_ms()), (10, 1, 90));
    }

    #[test]
    fn a_long_one_is_bounded_and_its_merge_keeps_means_extremes_and_totals() {
        let mut t = Timeline::new();
        let n = 50 * SAMPLES_MAX as u64 + 3;
        for i in 0..n {
            t.observe(sample(i));
        }
        let samples = t.samples();
        assert!(samples.len() <= SAMPLES_MAX && samples.len() > SAMPLES_MAX / 4, "{}", samples.len());
        assert_eq!(t.observed(), n);
        assert!(t.stride().is_power_of_two() && t.stride() > 1);
        // The first sample is the first `stride` observations merged.
        let s = t.stride();
        let first = samples[0];
        assert_eq!(first.at_ms, 0);
        assert_eq!(first.queue_depth, 6, "the most");
        assert_eq!(first.nodes_up, 96, "the fewest");
        assert_eq!((first.faults, first.checks), ((s - 1) / 3, s - 1), "the last of the counters");
        let mean = (0..s).map(|i| (i % 10) as f64 / 10.0).sum::<f64>() / s as f64;
        assert!((first.gpu_utilization - mean).abs() < 1e-9);
        // The end is the last observation, whatever was merged.
        assert_eq!(samples.last().unwrap().checks, n - 1);
        assert_eq!(t.end_ms(), (n - 1) * 10);
        assert!(samples.windows(2).all(|w| w[0].at_ms < w[1].at_ms));
    }

    #[test]
    fn time_never_runs_backwards_and_marks_extend_the_end() {
        let mut t = Timeline::new();
        t.observe(Sample { at_ms: 100, ..Sample::default() });
        t.observe(Sample { at_ms: 50, ..Sample::default() });
        assert_eq!(t.samples()[1].at_ms, 100);
        t.mark(MarkKind::Failure, 400, "broken");
        assert_eq!(t.end_ms(), 400);
        assert_eq!(MarkKind::Failure.id(), "mark-failure");
    }
}
