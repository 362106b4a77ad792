//! Granule's derive macros. This crate owns `#[derive(Footprint)]` only: the code it
//! generates implements `granule_runtime::Footprint` (re-exported as
//! `granule::Footprint`), whose contract lives with the trait in
//! `crates/runtime/src/footprint.rs`. It owns no runtime code and is never a dependency
//! applications name: they get the derive through `granule` (or `granule-runtime`).
//!
//! What the derived impl counts: `footprint()` is `size_of::<Self>()` plus every field's
//! `heap_bytes()`, and `heap_bytes()` is that sum alone. A field's inline bytes are
//! already inside `size_of::<Self>()`, so adding its `footprint()` would count them twice
//! (the same rule the trait's impls for tuples and containers follow). For an enum only
//! the fields of the variant the value holds are counted.
//!
//! Where the trait is found: the generated impl names it through the crate the user
//! depends on, found in their `Cargo.toml` (`granule`, else `granule-runtime`, else
//! `granule-sharded`, which re-exports it; under whatever name it was renamed to), or
//! through `#[footprint(crate = "path")]` when none is a direct dependency (a crate
//! that re-exports `granule`).
#![forbid(unsafe_code)]

use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as Tokens};
use proc_macro_crate::{crate_name, FoundCrate};
use quote::{format_ident, quote};
use syn::{parse_macro_input, parse_quote, Data, DeriveInput, Fields, Path};

/// `#[derive(Footprint)]`: memory accounting for a struct or enum whose fields all
/// implement `Footprint`. Type parameters get a `T: Footprint` bound.
///
/// ```ignore
/// #[derive(granule::Footprint)]
/// struct Doc { id: u64, words: Vec<String> }
/// ```
///
/// Override the path the impl names the trait through with
/// `#[footprint(crate = "my_reexport::granule")]`.
#[proc_macro_derive(Footprint, attributes(footprint))]
pub fn derive_footprint(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    match expand(input) {
        Ok(t) => t.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

fn expand(mut input: DeriveInput) -> syn::Result<Tokens> {
    let krate = crate_path(&input)?;
    let trait_path: Path = parse_quote!(#krate::Footprint);
    for p in input.generics.type_params_mut() {
        p.bounds.push(parse_quote!(#trait_path));
    }
    let (impl_g, ty_g, where_g) = input.generics.split_for_impl();
    let name = &input.ident;
    let heap = match &input.data {
        Data::Struct(s) => {
            let (pattern, sum) = destructure(&s.fields, &trait_path);
            quote! { let Self #pattern = self; #sum }
        }
        Data::Enum(e) => {
            let arms = e.variants.iter().map(|v| {
                let vname = &v.ident;
                let (pattern, sum) = destructure(&v.fields, &trait_path);
                quote! { Self::#vname #pattern => { #sum } }
            });
            // An enum without variants has no values: `match *self {}` proves it.
            if e.variants.is_empty() {
                quote! { match *self {} }
            } else {
                quote! { match self { #(#arms)* } }
            }
        }
        Data::Union(u) => {
            return Err(syn::Error::new(
                u.union_token.span,
                "Footprint cannot be derived for a union (which field holds the value is unknown): implement it by hand",
            ))
        }
    };
    Ok(quote! {
        #[automatically_derived]
        impl #impl_g #trait_path for #name #ty_g #where_g {
            fn footprint(&self) -> u64 {
                ::core::mem::size_of::<Self>() as u64 + #trait_path::heap_bytes(self)
            }
            #[allow(unused_variables)]
            fn heap_bytes(&self) -> u64 {
                #heap
            }
        }
    })
}

/// A pattern binding every field of `fields` (`{ a: __f0, .. }`, `(__f0, ..)` or
/// nothing) and the sum of their heap bytes.
fn destructure(fields: &Fields, trait_path: &Path) -> (Tokens, Tokens) {
    let binds: Vec<_> = (0..fields.len()).map(|i| format_ident!("__f{i}")).collect();
    let pattern = match fields {
        Fields::Named(named) => {
            let names = named.named.iter().map(|f| &f.ident);
            quote! { { #(#names: #binds),* } }
        }
        Fields::Unnamed(_) => quote! { ( #(#binds),* ) },
        Fields::Unit => quote! {},
    };
    let sum = quote! { 0u64 #(+ #trait_path::heap_bytes(#binds))* };
    (pattern, sum)
}

/// The path of the crate that exports the trait, for this user.
fn crate_path(input: &DeriveInput) -> syn::Result<Path> {
    for attr in &input.attrs {
        if !attr.path().is_ident("footprint") {
            continue;
        }
        let mut found = None;
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("crate") {
                let s: syn::LitStr = meta.value()?.parse()?;
                found = Some(s.parse::<Path>()?);
                Ok(())
            } else {
                Err(meta.error("unknown footprint attribute (expected `crate = \"path\"`)"))
            }
        })?;
        if let Some(p) = found {
            return Ok(p);
        }
    }
    for package in ["granule", "granule-runtime", "granule-sharded"] {
        match crate_name(package) {
            Ok(FoundCrate::Name(name)) => {
                let id = syn::Ident::new(&name, Span::call_site());
                return Ok(parse_quote!(::#id));
            }
            // The package deriving is `granule` or `granule-runtime` itself: its tests
            // and examples name it by its crate name (the runtime's library makes
            // `::granule_runtime` name itself with `extern crate self`).
            Ok(FoundCrate::Itself) => {
                let id = syn::Ident::new(&package.replace('-', "_"), Span::call_site());
                return Ok(parse_quote!(::#id));
            }
            Err(_) => continue,
        }
    }
    Err(syn::Error::new(
        Span::call_site(),
        "#[derive(Footprint)] needs `granule` (or `granule-runtime`) as a direct dependency; \
         when the trait comes through another crate, name it: #[footprint(crate = \"path::to::granule\")]",
    ))
}
