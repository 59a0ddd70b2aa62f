//! Network interfaces by name: which one a rank listens on
//! (`PERSEUS_GLOO_NETWORK_INTERFACE`).

use std::ffi::CStr;
use std::net::Ipv4Addr;

/// The IPv4 address of interface `name`, or None when it has none or does not exist.
pub fn ipv4_of(name: &str) -> Option<Ipv4Addr> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return None;
    }
    let mut found = None;
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` walks the list getifaddrs returned; each node is valid until freed.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let n = unsafe { CStr::from_ptr(ifa.ifa_name) };
        // SAFETY: ifa_addr points to a sockaddr whose family says how to read it.
        if n.to_bytes() != name.as_bytes()
            || i32::from(unsafe { (*ifa.ifa_addr).sa_family }) != libc::AF_INET
        {
            continue;
        }
        // SAFETY: an AF_INET address is a sockaddr_in.
        let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
        found = Some(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
        break;
    }
    // SAFETY: frees the list getifaddrs allocated, once.
    unsafe { libc::freeifaddrs(head) };
    found
}

#[cfg(test)]
mod tests {
    use super::ipv4_of;

    #[test]
    fn loopback_has_its_address_and_unknown_names_have_none() {
        assert_eq!(ipv4_of("lo"), Some(std::net::Ipv4Addr::LOCALHOST));
        assert_eq!(ipv4_of("no-such-if0"), None);
    }
}
