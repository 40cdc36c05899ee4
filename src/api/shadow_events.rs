//! The JSON-lines sink of `RateLimitShadowBlock` events (`[policy] shadow_events_file`):
//! one line per request a shadow rule would have refused
//! (`crate::core::shadow_report::ShadowEvent`), for `quotamesh policy shadow-report`.
//!
//! The request path never waits on the disk: events go through a bounded queue to one
//! writer task, and an event that finds the queue full is dropped and counted
//! (`quotamesh_rls_shadow_events_dropped_total`). The file is bounded too: past
//! `max_bytes` it is renamed to `FILE.1` (replacing the last one) and started anew. Lines
//! reach the file once the queue is drained, at least every second.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::sync::mpsc;

use crate::core::shadow_report::ShadowEvent;
use crate::metrics::Metrics;

/// Events waiting for the writer; past it they are dropped and counted.
pub const SHADOW_EVENTS_QUEUED_MAX: usize = 8_192;
/// Longest a written line waits in the buffer before it is flushed.
const FLUSH_INTERVAL: Duration = Duration::from_secs(1);

/// The request path's handle on the sink.
#[derive(Clone)]
pub struct ShadowSink {
    sender: mpsc::Sender<ShadowEvent>,
    metrics: Metrics,
}

impl ShadowSink {
    /// Opens `path` for appending and starts its writer task, which ends once every handle
    /// is dropped.
    ///
    /// # Errors
    /// The error of opening the file (a missing directory, permissions).
    pub fn open(path: &Path, max_bytes: u64, metrics: Metrics) -> std::io::Result<Self> {
        let file = open_append(path)?;
        let (sender, receiver) = mpsc::channel(SHADOW_EVENTS_QUEUED_MAX);
        let writer = Writer {
            path: path.to_owned(),
            max_bytes,
            file,
            metrics: metrics.clone(),
            failing: false,
        };
        tokio::spawn(writer.run(receiver));
        Ok(Self { sender, metrics })
    }

    /// Queues `event`; drops and counts it when the queue is full.
    pub fn record(&self, event: ShadowEvent) {
        if self.sender.try_send(event).is_err() {
            self.metrics.rls_shadow_events_dropped.inc();
        }
    }
}

fn open_append(path: &Path) -> std::io::Result<std::io::BufWriter<std::fs::File>> {
    let file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
    Ok(std::io::BufWriter::new(file))
}

struct Writer {
    path: PathBuf,
    max_bytes: u64,
    file: std::io::BufWriter<std::fs::File>,
    metrics: Metrics,
    /// Writing failed since the last line written.
    failing: bool,
}

impl Writer {
    async fn run(mut self, mut receiver: mpsc::Receiver<ShadowEvent>) {
        let mut flush = tokio::time::interval(FLUSH_INTERVAL);
        loop {
            tokio::select! {
                event = receiver.recv() => {
                    let Some(event) = event else { break };
                    self.write(&event);
                    // Drain what is queued, then flush once.
                    while let Ok(event) = receiver.try_recv() {
                        self.write(&event);
                    }
                    self.flush();
                }
                _ = flush.tick() => self.flush(),
            }
        }
        self.flush();
    }

    /// Writes one line. An IO error (a full disk) drops the event, counted; it is logged
    /// when writing starts to fail, not for every event while it does.
    fn write(&mut self, event: &ShadowEvent) {
        let written = serde_json::to_writer(&mut self.file, event)
            .map_err(std::io::Error::from)
            .and_then(|()| self.file.write_all(b"\n"));
        match written {
            Ok(()) => self.failing = false,
            Err(error) => {
                self.metrics.rls_shadow_events_dropped.inc();
                if !std::mem::replace(&mut self.failing, true) {
                    tracing::warn!(
                        %error,
                        path = %self.path.display(),
                        "shadow events not written (counted in \
                         quotamesh_rls_shadow_events_dropped_total until writing works again)"
                    );
                }
            }
        }
    }

    /// Flushes, and rotates the file once it is past `max_bytes`.
    fn flush(&mut self) {
        if let Err(error) = self.file.flush() {
            tracing::warn!(%error, path = %self.path.display(), "shadow events not flushed");
            return;
        }
        let size = self.file.get_ref().metadata().map_or(0, |metadata| metadata.len());
        if size < self.max_bytes {
            return;
        }
        let mut rotated = self.path.clone().into_os_string();
        rotated.push(".1");
        let reopened = std::fs::rename(&self.path, &rotated).and_then(|()| open_append(&self.path));
        match reopened {
            Ok(file) => self.file = file,
            Err(error) => {
                tracing::warn!(%error, path = %self.path.display(), "shadow events not rotated");
            }
        }
    }
}
