//! Closed sets of named values (`--mode`, layout kinds, palettizers, ...):
//! each name is written once, in the [`named!`] invocation that defines the
//! enum, and that one table is its `as_str`, its `FromStr`, its serde form, its
//! JSON schema and the CLI's list of possible values.

/// What every [`named!`] enum is: a closed set of names.
pub trait Named: Copy + std::str::FromStr + 'static {
    /// Every name, in declaration order.
    const NAMES: &'static [&'static str];
    /// Each value's doc comment, for `--help`.
    const DOCS: &'static [&'static str];
    fn as_str(self) -> &'static str;
}

/// `named! { /// docs  pub enum Mode { /// docs  Four = "four", ... } }`
#[macro_export]
macro_rules! named {
    ($(#[$meta:meta])* pub enum $name:ident { $($(#[doc = $vdoc:literal])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name { $($(#[doc = $vdoc])* $variant),+ }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];
            /// Every name, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($text),+];
            /// Each value's doc comment (empty without one), in declaration order.
            pub const DOCS: &'static [&'static str] = &[$(concat!("" $(, $vdoc)*)),+];

            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }
        }

        impl $crate::names::Named for $name {
            const NAMES: &'static [&'static str] = $name::NAMES;
            const DOCS: &'static [&'static str] = $name::DOCS;
            fn as_str(self) -> &'static str {
                $name::as_str(self)
            }
        }

        $crate::by_name!($name);

        impl std::str::FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($text => Ok($name::$variant),)+
                    _ => Err(format!(
                        "`{s}` is not one of {}",
                        $name::NAMES.join(", ")
                    )),
                }
            }
        }

        impl $crate::schemars::JsonSchema for $name {
            fn schema_name() -> std::borrow::Cow<'static, str> {
                stringify!($name).into()
            }

            fn json_schema(_: &mut $crate::schemars::SchemaGenerator) -> $crate::schemars::Schema {
                $crate::schemars::json_schema!({ "type": "string", "enum": $name::NAMES })
            }
        }
    };
}

/// `Display`, `Serialize` and `Deserialize` of a type written as its name:
/// `as_str` one way, `FromStr` (with `String` errors) the other.
#[doc(hidden)]
#[macro_export]
macro_rules! by_name {
    ($name:ident) => {
        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

#[cfg(test)]
mod tests {
    named! {
        /// A test set.
        pub enum Pet {
            /// Purrs.
            Cat = "cat",
            Dog = "dog",
        }
    }

    #[test]
    fn names_round_trip_through_str_and_serde() {
        for p in Pet::ALL {
            assert_eq!(p.as_str().parse::<Pet>(), Ok(*p));
            let j = serde_json::to_string(p).unwrap();
            assert_eq!(serde_json::from_str::<Pet>(&j).unwrap(), *p);
        }
        assert_eq!(Pet::NAMES, ["cat", "dog"]);
        assert_eq!(Pet::DOCS, [" Purrs.", ""]);
        assert!("cow".parse::<Pet>().unwrap_err().contains("cat, dog"));
    }
}
