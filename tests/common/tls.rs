//! Certificates and operator tokens for test clusters: a CA per cluster made in-process
//! with the library's own code (`quotamesh::tls::authority`, what `quotamesh cluster certs`
//! runs), a certificate per node, and the `[tls]` and `[admin]` sections that use them.

use std::path::{Path, PathBuf};

use quotamesh::api::billing::auth::token_sha256_hex;
use quotamesh::ledger::NodeId;
use quotamesh::tls::authority::{Authority, Issued};

/// The operator token every test node accepts for admin calls.
pub const ADMIN_TOKEN: &str = "test-operator-token";
/// The region named in test node certificates, unless a test names another.
pub const REGION: &str = "test";

/// The `[admin]` section accepting [`ADMIN_TOKEN`].
pub fn admin_section() -> String {
    format!(
        "[[admin.tokens]]\nname = \"test-operator\"\nsha256 = \"{}\"\n",
        token_sha256_hex(ADMIN_TOKEN)
    )
}

/// A cluster's CA, the directory its certificates are written to, and the region its node
/// certificates name.
pub struct TestCa {
    pub directory: PathBuf,
    pub authority: Authority,
    pub region: String,
}

impl TestCa {
    /// A new CA for `cluster_id`, writing into `<root>/certs`.
    pub fn new(root: &Path, cluster_id: &str) -> anyhow::Result<Self> {
        quotamesh::tls::install_crypto_provider();
        let directory = root.join("certs");
        std::fs::create_dir_all(&directory)?;
        let authority = Authority::generate(cluster_id, quotamesh::clock::now_ms(), 30)?;
        std::fs::write(directory.join("ca.pem"), authority.cert_pem())?;
        Ok(Self { directory, authority, region: REGION.to_owned() })
    }

    /// The CA of `other`, issuing certificates of voters of `region` into `<root>/certs`:
    /// another region of the same cluster, which regions authenticate each other by.
    pub fn sharing(root: &Path, other: &TestCa, region: &str) -> anyhow::Result<Self> {
        let directory = root.join("certs");
        std::fs::create_dir_all(&directory)?;
        other.authority.save(&directory)?;
        let authority = Authority::load(&directory)?;
        Ok(Self { directory, authority, region: region.to_owned() })
    }

    /// The bundle file the nodes trust.
    pub fn bundle(&self) -> PathBuf {
        self.directory.join("ca.pem")
    }

    /// Issues voter `id`'s certificate for `host` (what its peers dial).
    pub fn issue(&self, id: u64, host: &str) -> anyhow::Result<Issued> {
        let hosts = [host.to_owned()];
        let now_ms = quotamesh::clock::now_ms();
        Ok(self.authority.issue_node(&self.region, NodeId(id), &hosts, now_ms, 30)?)
    }

    /// Issues gateway `id`'s certificate for `host`.
    pub fn issue_gateway(&self, id: u64, host: &str) -> anyhow::Result<Issued> {
        let hosts = [host.to_owned()];
        let now_ms = quotamesh::clock::now_ms();
        Ok(self.authority.issue_gateway(&self.region, NodeId(id), &hosts, now_ms, 30)?)
    }

    /// Writes `issued` as `<name>.pem` and `<name>.key`; returns their paths.
    pub fn write(&self, name: &str, issued: &Issued) -> anyhow::Result<(PathBuf, PathBuf)> {
        let cert = self.directory.join(format!("{name}.pem"));
        let key = self.directory.join(format!("{name}.key"));
        std::fs::write(&cert, &issued.cert_pem)?;
        std::fs::write(&key, &issued.key_pem)?;
        Ok((cert, key))
    }

    /// Issues node `id`'s certificate for `host` (a gateway's when `gateway`), writes it,
    /// and returns its `[tls]` section.
    pub fn node_section(&self, id: u64, host: &str, gateway: bool) -> anyhow::Result<String> {
        let issued = if gateway { self.issue_gateway(id, host)? } else { self.issue(id, host)? };
        let (cert, key) = self.write(&format!("node-{id}"), &issued)?;
        Ok(format!(
            "[tls]\ncert = \"{}\"\nkey = \"{}\"\nca = \"{}\"\n",
            cert.display(),
            key.display(),
            self.bundle().display()
        ))
    }
}
