//! A `metrics` recorder that keeps counters by name (labels ignored), for tests of what is
//! published. Include with `#[path = "common/counters.rs"] mod counters;`.
#![allow(dead_code)]

/// Counters by name; gauges and histograms are dropped.
#[derive(Default, Clone)]
pub struct Counters(
    std::sync::Arc<
        std::sync::Mutex<
            std::collections::HashMap<String, std::sync::Arc<std::sync::atomic::AtomicU64>>,
        >,
    >,
);

struct Count(std::sync::Arc<std::sync::atomic::AtomicU64>);

impl metrics::CounterFn for Count {
    fn increment(&self, v: u64) {
        self.0.fetch_add(v, std::sync::atomic::Ordering::Relaxed);
    }
    fn absolute(&self, v: u64) {
        self.0.store(v, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Counters {
    pub fn get(&self, name: &str) -> u64 {
        let m = self.0.lock().unwrap();
        m.get(name)
            .map_or(0, |c| c.load(std::sync::atomic::Ordering::Relaxed))
    }
}

impl metrics::Recorder for Counters {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        let mut m = self.0.lock().unwrap();
        let c = m.entry(key.name().to_string()).or_default().clone();
        metrics::Counter::from_arc(std::sync::Arc::new(Count(c)))
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}
