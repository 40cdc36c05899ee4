//! The `netns` topology's network: one namespace per node, each with a veth pair whose
//! other end sits on a bridge, addresses `10.77.S.N/24` (node N, the runner `.254`), and an
//! nft table per namespace whose input and output chains drop traffic from and to the peers
//! a partition cuts off. The runner's own address is never cut, so it can always observe
//! the nodes. Everything is removed when the run ends.
//!
//! The bridge lives in a namespace of its own (the hub): bridged traffic in the runner's
//! namespace would pass the host's firewall, whose FORWARD policy is often DROP (Docker sets
//! it so). The runner reaches the bridge through one more veth pair; its packets to the
//! nodes are its own output, never forwarded.
//!
//! ```text
//!   runner 10.77.S.254 ── veth ──[hub: bridge]──┬── veth ── [n1: 10.77.S.1  nft drop ...]
//!                                              ├── veth ── [n2: 10.77.S.2]
//!                                              └── veth ── [n3: 10.77.S.3]
//! ```

use std::process::Stdio;
use std::time::Duration;

/// One `ip` or `nft` command may take this long.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);
/// The nft table the partitions' rules live in.
const TABLE: &str = "jepsen";

/// The namespaces, veths and bridge of one run.
pub struct Namespaces {
    /// Prefix of every name (namespaces, links), unique per run.
    prefix: String,
    /// The third octet of the run's subnet.
    subnet: u8,
    nodes: usize,
}

impl Namespaces {
    /// Creates the bridge and one namespace per node, with loopback and its address up and
    /// an empty nft table.
    ///
    /// # Errors
    /// An `ip` or `nft` command fails (not root, or no namespace support); what was made is
    /// removed again.
    pub async fn create(nodes: usize) -> anyhow::Result<Self> {
        anyhow::ensure!(nodes <= 250, "at most 250 nodes on one subnet");
        // Short names: links are at most 15 bytes.
        let unique =
            std::process::id() ^ u32::try_from(crate::run::unix_ms() % 65_536).unwrap_or(0);
        let prefix = format!("qj{:04x}", unique & 0xffff);
        let subnet = u8::try_from(unique % 250).unwrap_or(0);
        let namespaces = Self { prefix, subnet, nodes };
        if let Err(error) = namespaces.build().await {
            namespaces.destroy();
            return Err(error);
        }
        Ok(namespaces)
    }

    async fn build(&self) -> anyhow::Result<()> {
        let hub = self.hub();
        run(&["ip", "netns", "add", &hub]).await?;
        run(&["ip", "-n", &hub, "link", "add", "bridge", "type", "bridge"]).await?;
        run(&["ip", "-n", &hub, "link", "set", "bridge", "up"]).await?;
        let runner = self.runner_link();
        let runner_peer = format!("{}rh", self.prefix);
        run(&["ip", "link", "add", &runner, "type", "veth", "peer", "name", &runner_peer]).await?;
        run(&["ip", "link", "set", &runner_peer, "netns", &hub]).await?;
        run(&["ip", "-n", &hub, "link", "set", &runner_peer, "master", "bridge", "up"]).await?;
        let runner_address = format!("10.77.{}.254/24", self.subnet);
        run(&["ip", "addr", "add", &runner_address, "dev", &runner]).await?;
        run(&["ip", "link", "set", &runner, "up"]).await?;
        for position in 0..self.nodes {
            let namespace = self.namespace(position);
            let outside = format!("{}v{}", self.prefix, position + 1);
            let inside = format!("{}p{}", self.prefix, position + 1);
            run(&["ip", "netns", "add", &namespace]).await?;
            run(&["ip", "link", "add", &outside, "type", "veth", "peer", "name", &inside]).await?;
            run(&["ip", "link", "set", &inside, "netns", &namespace]).await?;
            run(&["ip", "link", "set", &outside, "netns", &hub]).await?;
            run(&["ip", "-n", &hub, "link", "set", &outside, "master", "bridge", "up"]).await?;
            run(&["ip", "-n", &namespace, "link", "set", "lo", "up"]).await?;
            let address = format!("{}/24", self.address(position));
            run(&["ip", "-n", &namespace, "addr", "add", &address, "dev", &inside]).await?;
            run(&["ip", "-n", &namespace, "link", "set", &inside, "up"]).await?;
            let table = format!(
                "table inet {TABLE} {{\n chain input {{ type filter hook input priority 0; }}\n \
                 chain output {{ type filter hook output priority 0; }}\n}}\n"
            );
            nft(&namespace, &["-f", "-"], Some(&table)).await?;
        }
        Ok(())
    }

    /// The namespace holding the bridge.
    fn hub(&self) -> String {
        format!("{}h", self.prefix)
    }

    /// The runner's end of its link to the bridge.
    fn runner_link(&self) -> String {
        format!("{}r", self.prefix)
    }

    /// Node `position`'s namespace.
    pub fn namespace(&self, position: usize) -> String {
        format!("{}n{}", self.prefix, position + 1)
    }

    /// Node `position`'s address.
    pub fn address(&self, position: usize) -> String {
        format!("10.77.{}.{}", self.subnet, position + 1)
    }

    /// Cuts the links `pairs` (of node positions), both ways, on both ends.
    ///
    /// # Errors
    /// An nft command fails.
    pub async fn partition(&self, pairs: &[(usize, usize)]) -> anyhow::Result<()> {
        for position in 0..self.nodes {
            let peers: Vec<usize> = pairs
                .iter()
                .filter_map(|(first, second)| match position {
                    _ if position == *first => Some(*second),
                    _ if position == *second => Some(*first),
                    _ => None,
                })
                .collect();
            self.drop_rules(position, &peers, &peers).await?;
        }
        Ok(())
    }

    /// Cuts the directed links `links` ((sender, receiver) positions): each receiver drops
    /// what its senders send; what it sends still goes out.
    ///
    /// # Errors
    /// An nft command fails.
    pub async fn partition_one_way(&self, links: &[(usize, usize)]) -> anyhow::Result<()> {
        for position in 0..self.nodes {
            let senders: Vec<usize> = links
                .iter()
                .filter(|(_, receiver)| *receiver == position)
                .map(|(sender, _)| *sender)
                .collect();
            self.drop_rules(position, &senders, &[]).await?;
        }
        Ok(())
    }

    /// In node `position`'s namespace: drops what comes from `from` and what goes to `to`.
    async fn drop_rules(
        &self,
        position: usize,
        from: &[usize],
        to: &[usize],
    ) -> anyhow::Result<()> {
        let set = |peers: &[usize]| {
            peers.iter().map(|peer| self.address(*peer)).collect::<Vec<_>>().join(", ")
        };
        let mut rules = String::new();
        if !from.is_empty() {
            rules.push_str(&format!(
                "add rule inet {TABLE} input ip saddr {{ {} }} drop\n",
                set(from)
            ));
        }
        if !to.is_empty() {
            rules.push_str(&format!(
                "add rule inet {TABLE} output ip daddr {{ {} }} drop\n",
                set(to)
            ));
        }
        if rules.is_empty() {
            return Ok(());
        }
        nft(&self.namespace(position), &["-f", "-"], Some(&rules)).await
    }

    /// Removes every partition rule.
    ///
    /// # Errors
    /// An nft command fails.
    pub async fn heal(&self) -> anyhow::Result<()> {
        for position in 0..self.nodes {
            let namespace = self.namespace(position);
            nft(&namespace, &["flush", "chain", "inet", TABLE, "input"], None).await?;
            nft(&namespace, &["flush", "chain", "inet", TABLE, "output"], None).await?;
        }
        Ok(())
    }

    /// Removes the namespaces (their veths go with them, the runner's included) and the
    /// runner's link should it remain. Synchronous, so it also runs from `Drop`.
    pub fn destroy(&self) {
        let ip = |arguments: &[&str]| {
            let _ = std::process::Command::new("ip")
                .args(arguments)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        };
        for position in 0..self.nodes {
            ip(&["netns", "del", &self.namespace(position)]);
        }
        ip(&["netns", "del", &self.hub()]);
        ip(&["link", "del", &self.runner_link()]);
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        self.destroy();
    }
}

/// `nft` in `namespace`, with `input` on stdin when given.
async fn nft(namespace: &str, arguments: &[&str], input: Option<&str>) -> anyhow::Result<()> {
    let mut command = vec!["ip", "netns", "exec", namespace, "nft"];
    command.extend_from_slice(arguments);
    super::run_command(&command, input, COMMAND_TIMEOUT).await
}

async fn run(command: &[&str]) -> anyhow::Result<()> {
    super::run_command(command, None, COMMAND_TIMEOUT).await
}
