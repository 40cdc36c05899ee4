//! A small YAML tree that remembers where every node came from.
//!
//! Built from the event parser that serde-saphyr itself runs on (`granit_parser`, re-exported
//! as `serde_saphyr::granit_parser`). We do not deserialize through serde: a serde visitor
//! stops at the first error of a file, and policy validation must report every error with
//! its line and column, including semantic ones found long after the value was read.
//! `serde_saphyr::Spanned<T>` gives locations, but only on a path that aborts at the first
//! failure, so we keep our own located tree instead.
//!
//! This file knows YAML (anchors, aliases, `<<` merge keys, tags, one document per file) and
//! nothing about policies; `load.rs` gives the tree its meaning.

use std::collections::HashMap;

use serde_saphyr::granit_parser::{Event, Marker, Options, Parser, ScalarStyle, Tag};

/// Deepest nesting of YAML collections accepted, aliases expanded. A policy at the deepest
/// descriptor nesting needs about 40 levels (see the assertion in `load.rs`); the bound
/// keeps every recursive walk over the tree shallow.
pub(super) const YAML_DEPTH_MAX: usize = 64;

/// Most YAML nodes accepted in one file, aliases expanded: anchors can otherwise make a
/// small text expand exponentially ("billion laughs").
pub(super) const YAML_NODES_MAX: u64 = 1_000_000;

/// A 1-based line and column (in characters) in one source text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Position {
    pub(super) line: u32,
    pub(super) column: u32,
}

impl Position {
    /// The first character of a text, for errors about a file as a whole.
    pub(super) const START: Position = Position { line: 1, column: 1 };

    fn from_marker(marker: &Marker) -> Self {
        // The parser counts lines from 1 and columns from 0.
        Self {
            line: u32::try_from(marker.line()).unwrap_or(u32::MAX),
            column: u32::try_from(marker.col().saturating_add(1)).unwrap_or(u32::MAX),
        }
    }
}

/// One YAML node and the position of its first character.
#[derive(Debug, Clone)]
pub(super) struct Node {
    pub(super) position: Position,
    pub(super) value: Value,
}

/// The content of a node.
#[derive(Debug, Clone)]
pub(super) enum Value {
    /// A scalar's text after YAML escape processing. `typed` is true for a plain, untagged
    /// scalar (the only kind that may read as null, a boolean or a number); quoted, block
    /// and `!!str` scalars are strings whatever they look like.
    Scalar {
        text: String,
        typed: bool,
    },
    Sequence(Vec<Node>),
    Mapping(Vec<MapEntry>),
}

/// One `key: value` pair of a mapping; keys are always strings in a policy.
#[derive(Debug, Clone)]
pub(super) struct MapEntry {
    pub(super) key: String,
    pub(super) key_position: Position,
    pub(super) value: Node,
}

impl Node {
    /// True for an empty value, `~` or `null` written plain: an absent value in YAML.
    pub(super) fn is_null(&self) -> bool {
        matches!(&self.value, Value::Scalar { text, typed: true }
            if matches!(text.as_str(), "" | "~" | "null" | "Null" | "NULL"))
    }

    /// What this node is, quoting a scalar, for "expected X, found Y" messages.
    pub(super) fn found(&self) -> String {
        match &self.value {
            _ if self.is_null() => "nothing".to_owned(),
            Value::Scalar { text, typed: true } => format!("`{text}`"),
            Value::Scalar { text, typed: false } => format!("the string {text:?}"),
            Value::Sequence(_) => "a list".to_owned(),
            Value::Mapping(_) => "a mapping".to_owned(),
        }
    }
}

/// A problem found while reading YAML, positioned in the text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Diagnostic {
    pub(super) position: Position,
    pub(super) reason: String,
}

/// What one text held: its root node (`None` for a text without content) and every problem
/// found on the way. A syntax error ends the tree early, so `root` is `None` after one.
#[derive(Debug)]
pub(super) struct Document {
    pub(super) root: Option<Node>,
    pub(super) diagnostics: Vec<Diagnostic>,
}

/// Reads one YAML document into a located tree.
pub(super) fn parse(text: &str) -> Document {
    let mut options = Options::default();
    // Comments carry no policy; the limits keep a hostile file from nesting past what the
    // tree walks are sized for.
    options.set_emit_comments(false);
    options.flow_nesting_limit = YAML_DEPTH_MAX;
    options.block_nesting_limit = YAML_DEPTH_MAX;
    let mut builder = Builder::default();
    let mut documents_seen = 0_u32;
    for event in Parser::new_from_str_with_options(text, options) {
        let (event, span) = match event {
            Ok(pair) => pair,
            Err(error) => {
                builder.fail(
                    Position::from_marker(error.marker()),
                    format!("invalid YAML: {}", error.info()),
                );
                break;
            }
        };
        let position = Position::from_marker(&span.start);
        match event {
            Event::DocumentStart(..) => {
                documents_seen += 1;
                if documents_seen > 1 {
                    // The first document is complete and still worth validating.
                    builder.report(
                        position,
                        "a policy file holds one YAML document, found a second one (`---`)",
                    );
                    break;
                }
            }
            Event::Scalar(text, style, anchor_id, tag) => {
                let tag_position = span.tag_start.as_ref().map_or(position, Position::from_marker);
                let untagged_or_core = builder.check_tag(tag.as_deref(), tag_position);
                let typed = style == ScalarStyle::Plain && untagged_or_core;
                if builder.charge(1, position) {
                    let node =
                        Node { position, value: Value::Scalar { text: text.into_owned(), typed } };
                    builder.complete(node, 1, 1, anchor_id);
                }
            }
            Event::SequenceStart(_, anchor_id, tag) => {
                builder.check_tag(
                    tag.as_deref(),
                    span.tag_start.as_ref().map_or(position, Position::from_marker),
                );
                builder.open(position, anchor_id, Open::Sequence(Vec::new()));
            }
            Event::MappingStart(_, anchor_id, tag) => {
                builder.check_tag(
                    tag.as_deref(),
                    span.tag_start.as_ref().map_or(position, Position::from_marker),
                );
                builder.open(position, anchor_id, Open::Mapping(OpenMapping::default()));
            }
            Event::SequenceEnd | Event::MappingEnd => builder.close(),
            Event::Alias(anchor_id) => builder.alias(anchor_id, position),
            // Stream and document ends, and metadata events we did not ask for.
            _ => {}
        }
        if builder.failed {
            break;
        }
    }
    Document {
        root: if builder.failed { None } else { builder.root },
        diagnostics: builder.diagnostics,
    }
}

/// A collection whose end event has not been seen yet.
struct Frame {
    position: Position,
    anchor_id: usize,
    /// Height of the tallest child so far (a scalar has height 1).
    child_height: usize,
    /// Nodes in this collection so far, itself included.
    nodes: u64,
    open: Open,
}

enum Open {
    Sequence(Vec<Node>),
    Mapping(OpenMapping),
}

#[derive(Default)]
struct OpenMapping {
    entries: Vec<MapEntry>,
    /// Where each key was first seen, to reject a key written twice.
    seen: HashMap<String, Position>,
    pending: PendingKey,
    /// Values of `<<` keys, applied when the mapping closes (explicit keys win).
    merges: Vec<Node>,
}

#[derive(Default)]
enum PendingKey {
    /// The next node is a key.
    #[default]
    None,
    /// The next node is the value of this key.
    Key { text: String, position: Position, merge: bool },
    /// The next node is the value of a key we already reported as unusable.
    Skip,
}

/// An anchored node kept for its aliases, with its size so an alias can be charged for it.
struct Anchored {
    node: Node,
    height: usize,
    nodes: u64,
}

#[derive(Default)]
struct Builder {
    stack: Vec<Frame>,
    anchors: HashMap<usize, Anchored>,
    root: Option<Node>,
    diagnostics: Vec<Diagnostic>,
    nodes_total: u64,
    failed: bool,
}

impl Builder {
    /// Records a problem after which the rest of the text cannot be read.
    fn fail(&mut self, position: Position, reason: impl Into<String>) {
        self.diagnostics.push(Diagnostic { position, reason: reason.into() });
        self.failed = true;
    }

    fn report(&mut self, position: Position, reason: impl Into<String>) {
        self.diagnostics.push(Diagnostic { position, reason: reason.into() });
    }

    /// Accepts core-schema tags and reports others; returns false when the tag forces a
    /// string (`!!str`), so a plain scalar is not read as a number, boolean or null.
    fn check_tag(&mut self, tag: Option<&Tag>, position: Position) -> bool {
        let Some(tag) = tag else { return true };
        match tag.core_suffix() {
            Some("str") => false,
            Some(_) => true,
            None => {
                self.report(position, format!("unsupported YAML tag `{}`", tag.original()));
                true
            }
        }
    }

    fn open(&mut self, position: Position, anchor_id: usize, open: Open) {
        if self.stack.len() >= YAML_DEPTH_MAX {
            self.fail(
                position,
                format!("YAML nested deeper than {YAML_DEPTH_MAX} levels (input size limit)"),
            );
            return;
        }
        if !self.charge(1, position) {
            return;
        }
        self.stack.push(Frame { position, anchor_id, child_height: 0, nodes: 1, open });
    }

    fn close(&mut self) {
        let Some(frame) = self.stack.pop() else { return };
        let value = match frame.open {
            Open::Sequence(items) => Value::Sequence(items),
            Open::Mapping(mapping) => Value::Mapping(self.apply_merges(mapping)),
        };
        let node = Node { position: frame.position, value };
        // The frame's own node was counted when it opened; its children as they completed.
        self.complete(node, frame.child_height.saturating_add(1), frame.nodes, frame.anchor_id);
    }

    fn alias(&mut self, anchor_id: usize, position: Position) {
        let Some(anchored) = self.anchors.get(&anchor_id) else {
            // The parser resolves names, so a miss means the alias sits inside the node it names.
            self.fail(position, "an alias may not refer to a node that contains it");
            return;
        };
        if self.stack.len().saturating_add(anchored.height) > YAML_DEPTH_MAX {
            let reason = format!(
                "YAML nested deeper than {YAML_DEPTH_MAX} levels once aliases are expanded \
                 (input size limit)"
            );
            self.fail(position, reason);
            return;
        }
        let (height, nodes) = (anchored.height, anchored.nodes);
        // Charge before cloning, so an expanding alias is refused before it costs memory.
        if !self.charge(nodes, position) {
            return;
        }
        if let Some(anchored) = self.anchors.get(&anchor_id) {
            let node = anchored.node.clone();
            self.complete(node, height, nodes, 0);
        }
    }

    /// Counts `nodes` new nodes against [`YAML_NODES_MAX`]; false (and the text abandoned)
    /// once the budget is spent.
    fn charge(&mut self, nodes: u64, position: Position) -> bool {
        self.nodes_total = self.nodes_total.saturating_add(nodes);
        if self.nodes_total > YAML_NODES_MAX {
            let reason = format!(
                "more than {YAML_NODES_MAX} YAML nodes once aliases are expanded (input size limit)"
            );
            self.fail(position, reason);
            return false;
        }
        true
    }

    /// Attaches a finished node to its parent (or makes it the root).
    fn complete(&mut self, node: Node, height: usize, nodes: u64, anchor_id: usize) {
        if anchor_id != 0 {
            self.anchors.insert(anchor_id, Anchored { node: node.clone(), height, nodes });
        }
        let Some(frame) = self.stack.last_mut() else {
            self.root = Some(node);
            return;
        };
        frame.child_height = frame.child_height.max(height);
        frame.nodes = frame.nodes.saturating_add(nodes);
        let problem = match &mut frame.open {
            Open::Sequence(items) => {
                items.push(node);
                None
            }
            Open::Mapping(mapping) => Self::attach_to_mapping(mapping, node),
        };
        if let Some((position, reason)) = problem {
            self.report(position, reason);
        }
    }

    /// Feeds a key or a value to an open mapping; returns a problem to report, if any.
    fn attach_to_mapping(mapping: &mut OpenMapping, node: Node) -> Option<(Position, String)> {
        match std::mem::take(&mut mapping.pending) {
            PendingKey::None => match node.value {
                Value::Scalar { text, typed } => {
                    let merge = typed && text == "<<";
                    mapping.pending = PendingKey::Key { text, position: node.position, merge };
                    None
                }
                Value::Sequence(_) | Value::Mapping(_) => {
                    mapping.pending = PendingKey::Skip;
                    Some((
                        node.position,
                        "mapping keys must be strings, found a collection".to_owned(),
                    ))
                }
            },
            PendingKey::Skip => None,
            PendingKey::Key { merge: true, .. } => {
                mapping.merges.push(node);
                None
            }
            PendingKey::Key { text, position, merge: false } => {
                if let Some(first) = mapping.seen.get(&text) {
                    return Some((
                        position,
                        format!(
                            "key `{text}` appears twice in one mapping (first at line {})",
                            first.line
                        ),
                    ));
                }
                mapping.seen.insert(text.clone(), position);
                mapping.entries.push(MapEntry { key: text, key_position: position, value: node });
                None
            }
        }
    }

    /// Adds the entries of `<<` merge values that the mapping does not set itself; earlier
    /// merge sources win over later ones, as YAML's merge key type specifies.
    fn apply_merges(&mut self, mapping: OpenMapping) -> Vec<MapEntry> {
        let OpenMapping { mut entries, mut seen, merges, .. } = mapping;
        for source in merges {
            let sources = match source.value {
                Value::Mapping(merged) => vec![merged],
                Value::Sequence(items) => {
                    let mut merged = Vec::with_capacity(items.len());
                    for item in items {
                        match item.value {
                            Value::Mapping(item_entries) => merged.push(item_entries),
                            _ => self
                                .report(item.position, "a `<<` merge list may hold only mappings"),
                        }
                    }
                    merged
                }
                Value::Scalar { .. } => {
                    self.report(
                        source.position,
                        "a `<<` merge needs a mapping or a list of mappings",
                    );
                    Vec::new()
                }
            };
            for entry in sources.into_iter().flatten() {
                if !seen.contains_key(&entry.key) {
                    seen.insert(entry.key.clone(), entry.key_position);
                    entries.push(entry);
                }
            }
        }
        entries
    }
}
