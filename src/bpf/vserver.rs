//! One packet vserver as the runtime drives it: its firewalls, its selector and the program
//! on its interfaces. IO (a thin shell: the table is `crate::packet::build_table`, the
//! ranking `crate::select`).
//!
//! The runtime starts it with the vserver's `interface` list, method and masks, `lb` (the
//! hash algorithm, fingers and prac bound every vserver uses) and its services in config
//! order; slot `i + 1` is service `i`. On every health change it calls
//! [`PacketVserver::set_up`]: a new table from the selector for that UP set, swapped in
//! whole, so only the buckets of a firewall that went DOWN move (and come back when it is
//! UP again).

use super::{BpfError, Counters, PacketPath, host_addresses};
use crate::config::LbParams;
use crate::packet::{MAX_LEGS, PathConfig, build_table};
use crate::select::{HashSelector, Member};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;

/// A firewall leg: a `protocol: ip` service of the vserver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Firewall {
    /// Its address: the next hop the kernel resolves to a MAC, and its identity when it
    /// has no `hash_id`.
    pub address: IpAddr,
    /// Its other-family address on the same link, if any (an IPv6 packet needs an IPv6 next
    /// hop).
    pub other_address: Option<IpAddr>,
    /// The interface it is reached on.
    pub interface: String,
    /// Its place in the ranking: identity (`hash_id`, shared by a firewall's legs) and weight.
    pub member: Member,
}

impl Firewall {
    /// A firewall at `address` on `interface`, ranked by `hash_id` (else its address, port 0)
    /// with `weight`, as `crate::balancer` ranks every service.
    pub fn new(address: IpAddr, interface: &str, hash_id: Option<&str>, weight: u32) -> Firewall {
        Firewall {
            address,
            other_address: None,
            interface: interface.to_string(),
            member: Member {
                id_hash: crate::hash::service_identity_hash(hash_id, &SocketAddr::new(address, 0)),
                weight,
            },
        }
    }
}

impl Firewall {
    /// Service `s` reached on `interface`: its address, `hash_id` and weight.
    pub fn of(s: &crate::config::Service, interface: &str) -> Firewall {
        Firewall::new(s.address.ip(), interface, s.hash_id.as_deref(), s.weight)
    }

    /// The same firewall with its other-family address on the same link.
    pub fn with_other_address(self, other: IpAddr) -> Firewall {
        Firewall {
            other_address: Some(other),
            ..self
        }
    }

    fn hops(&self) -> Vec<IpAddr> {
        std::iter::once(self.address)
            .chain(self.other_address)
            .collect()
    }
}

/// A running packet vserver.
#[derive(Debug)]
pub struct PacketVserver {
    path: PacketPath,
    selector: HashSelector,
    table: Vec<u32>,
}

fn ifindex(vserver: &str, name: &str) -> Result<u32, BpfError> {
    nix::net::if_::if_nametoindex(name).map_err(|e| BpfError::Interface {
        vserver: vserver.to_string(),
        interface: name.to_string(),
        source: io::Error::from(e),
    })
}

impl PacketVserver {
    /// Load, fill and attach vserver `name` on `interfaces`, its firewalls UP where `up`
    /// says. Every interface is looked up first: an unknown one fails before anything loads.
    pub fn start(
        name: &str,
        interfaces: &[String],
        config: &PathConfig,
        lb: &LbParams,
        firewalls: &[Firewall],
        up: &[bool],
    ) -> Result<PacketVserver, BpfError> {
        PacketVserver::start_at(
            name,
            interfaces,
            config,
            lb,
            firewalls,
            up,
            Path::new(super::PIN_ROOT),
        )
    }

    /// [`PacketVserver::start`], pinning under `root`.
    pub fn start_at(
        name: &str,
        interfaces: &[String],
        config: &PathConfig,
        lb: &LbParams,
        firewalls: &[Firewall],
        up: &[bool],
        root: &Path,
    ) -> Result<PacketVserver, BpfError> {
        if firewalls.len() > MAX_LEGS {
            return Err(BpfError::Slot {
                vserver: name.to_string(),
                slot: firewalls.len() as u32,
            });
        }
        let legs = firewalls
            .iter()
            .map(|f| ifindex(name, &f.interface))
            .collect::<Result<Vec<_>, _>>()?;
        for i in interfaces {
            ifindex(name, i)?;
        }
        let mut path = PacketPath::load_at(name, config, root)?;
        for (i, (f, index)) in firewalls.iter().zip(legs).enumerate() {
            path.set_leg(i as u32 + 1, index, &f.hops())?;
        }
        let locals = host_addresses().map_err(|source| BpfError::Kernel {
            vserver: name.to_string(),
            what: "list this host's addresses",
            source,
        })?;
        path.set_local_addresses(&locals)?;
        let members: Vec<Member> = firewalls.iter().map(|f| f.member).collect();
        let selector = crate::packet::selector(lb, &members, up);
        let table = build_table(&selector, |_| true);
        path.install_table(&table)?;
        for i in interfaces {
            path.attach(i)?;
        }
        Ok(PacketVserver {
            path,
            selector,
            table,
        })
    }

    /// The firewalls' health changed: `up[i]` for service `i`. Installs the new table when
    /// it differs; returns how many buckets moved.
    pub fn set_up(&mut self, up: &[bool]) -> Result<usize, BpfError> {
        let selector = self.selector.with_up(up);
        let table = build_table(&selector, |_| true);
        let moved = table
            .iter()
            .zip(&self.table)
            .filter(|(a, b)| a != b)
            .count();
        if moved > 0 {
            self.path.install_table(&table)?;
        }
        self.selector = selector;
        self.table = table;
        Ok(moved)
    }

    /// This host's addresses changed: packets to them go to the stack.
    pub fn refresh_local_addresses(&self) -> Result<(), BpfError> {
        let locals = host_addresses().map_err(self.path.kernel("list this host's addresses"))?;
        self.path.set_local_addresses(&locals)
    }

    /// The live bucket table.
    pub fn table(&self) -> &[u32] {
        &self.table
    }

    /// The program's counters (forwarded per firewall in service order).
    pub fn counters(&self) -> Result<Counters, BpfError> {
        self.path.counters()
    }

    /// Detach from every interface (the vserver is removed). Dropped without this, the
    /// pinned links keep forwarding with the last table, for the next start to take over.
    pub fn stop(mut self) -> Result<(), BpfError> {
        self.detach()
    }

    /// Detach from every interface and remove the pins: packets reach the stack again.
    pub fn detach(&mut self) -> Result<(), BpfError> {
        self.path.detach_all()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::{Masks, PacketMethod};

    /// An interface that does not exist is an error naming the vserver and the interface,
    /// before anything is loaded (so no BPF permission is needed to see it).
    #[test]
    fn an_unknown_interface_names_the_vserver() {
        let config = PathConfig {
            method: PacketMethod::SourceDestIp,
            masks: Masks::full(),
        };
        let fw = Firewall::new("10.0.0.1".parse().expect("ip"), "lo", Some("fw1"), 1);
        let e = PacketVserver::start(
            "outside",
            &["no-such-if0".to_string()],
            &config,
            &LbParams::default(),
            &[fw],
            &[true],
        )
        .expect_err("no such interface");
        let text = e.to_string();
        assert!(
            text.contains("vserver outside") && text.contains("no-such-if0"),
            "{text}"
        );
    }

    /// A firewall's two legs with one `hash_id` rank the same, whatever their addresses.
    #[test]
    fn legs_sharing_a_hash_id_rank_alike() {
        let a = Firewall::new("10.0.0.1".parse().expect("ip"), "a", Some("fw1"), 1);
        let b = Firewall::new("10.9.0.1".parse().expect("ip"), "b", Some("fw1"), 1);
        let c = Firewall::new("10.9.0.1".parse().expect("ip"), "b", None, 1);
        assert_eq!(a.member, b.member);
        assert_ne!(b.member, c.member);
    }
}
